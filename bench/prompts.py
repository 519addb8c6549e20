"""Prompts that make the default model write long, clean finance answers (for throughput)."""

LONG_ANSWERS = [
    "Write a detailed essay about the history of central banking.",
    "Explain, step by step, how a mortgage is paid off over thirty years.",
    "Describe the main differences between stocks, bonds and mutual funds.",
    "Write a long story about a young analyst on her first day at a bank.",
    "Explain how inflation affects savings, wages and interest rates.",
    "Describe how a credit card company makes money.",
    "Write a guide to building an emergency fund.",
    "Explain what a stock exchange does, in detail.",
]
