"""GPU benchmark (issue 10): the engine against the memory-bandwidth floor and transformers.

From the repository root (a package run with -m, so that it imports the same way from a
virtual environment's editable install as from PYTHONPATH=<pip --target dir>:<repo>):

    python -m bench.bench_gpu --tokenizer DIR [--deadline 570] [--phases ...]   # on a GPU
    .venv/bin/python -m bench.bench_gpu --tiny                                 # CPU dry run

One run of the default phases takes ~8 minutes on an H200 (2026-12-02: 9 s device, 41
model, 138 in-process, 74 transformers `generate_batch`, 131 served, ~65 transformers
`generate` of which ~41 compiling), each phase in its own process (GPU memory and compile
state stay apart), results written to the JSON after every phase, a table printed at the
end:

  device      copy bandwidth (device-to-device, bytes read + written; after ~1 s of copies,
              the clocks up) and bf16 matmul rate;
              the batch-1 floor = weight bytes read per step / bandwidth
  model       a Qwen2-7B-shaped model (hidden 3584, 28 layers, 28 heads, 4 KV heads,
              intermediate 18944) with random bf16 weights and the default model's
              tokenizer (vocabulary 49,152), saved as a Hugging Face directory
  inprocess   LLMEngine without gRPC: start-up (load, compile, graph capture), then rules
              off and rules on (default packs + 10,000 synthetic literals) at 1/16/64/128
              streams: tokens/s, TTFT p50/p99, step time (ITL) p50/p99, late repairs; each
              level twice: every stream started at once, and in the steady state (`steady`:
              streams out of phase, see run_engine_level); with --baselines, at 64+
              streams, rules on, the engine's own baselines: mixed steps off (`unmixed`
              and `steady-um`: FINSIEVE_MIXED_TOKENS=0, prefill in forwards of its own)
              and requests prepared on threads beside the loop (`steady-th`, the baseline
              of FINSIEVE_PREPARE_WORKERS); mixed steps whose prompt tokens are not cut to
              whole matmul tiles (`steady-ut`, the baseline of the scheduler's MIXED_TILE);
              64 requests arriving at once (TTFT, prefill FLOP/s); a bare prefill's FLOP/s
  serve       `finsieve serve --role engine` plus gateway processes on one SO_REUSEPORT
              port, client processes over gRPC: rules on, then off (hot reload to an
              empty pack), same levels, those of more than one stream in the steady state
              (`--serve-steady`); start-up until the engine is SERVING
  hf_batch    transformers continuous batching (`generate_batch`), 64 requests
  hf_generate transformers `generate`, static cache + torch.compile, batch 1 (as its
              generate compiles its decode step: CUDA graphs; --hf-compile)
  tests       (only when named) `make test-gpu`'s checks
  profile     (only when named) the decode step's kernels by device time at 1 and 64 rows,
              each weight's matmul alone against the copy bandwidth, a prefill forward's
              host and device time by size; `--sweeps`: the tile sweeps

Prompts are 128-512 tokens, 256 new tokens, greedy. Each stream sends `--rounds` requests
one after the other (a closed loop); tokens/s = completion tokens / wall time of the level
(through gRPC: from the first request sent to the last answer received).

The package: `cli` (options, the driver), `harness` (a phase's process, time, ports, device
facts), `rows` (a level's timings into its row), `workload` (the model, prompts and rules
benchmarked: public, other benches use it), one module per phase (`phases` names them),
`report` (the table, the JSON, issue #10's targets from `targets.toml`).
"""

import sys
from pathlib import Path

# The scripts beside this package (bench_rules' synthetic pack, provenance) import as they do
# when run, as top-level modules, however this package was imported.
_BENCH = str(Path(__file__).resolve().parents[1])
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)
