"""The officers' web console: search, review, rules over time, legal holds, exports and the
regulator package, served by the officers' process (`gateway/officers.py`) on its own port
(`FINSIEVE_CONSOLE_PORT`, off by default). See docs/compliance.md for what each page shows
and docs/security.md for its promises and the tests that hold them."""
