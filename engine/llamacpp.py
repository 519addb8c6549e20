"""The CPU's fast path: llama.cpp's forward over the model's GGUF, driven by the engine's loop.

On the CPU the float32 forward (model.py) reads every weight as float32 each step: ~540 MB
a token for the default model, against ~97 MB for its quantized GGUF, and issues hundreds
of torch operations a step from Python. llama.cpp runs the whole forward of a step in one
call on quantized weights (the default model's as Q8_0: requantize_q8_0). Only the forward
is llama.cpp's: the engine's loop, scheduler, sampler (the rules' masks are applied to the
logits this returns), guard, rollback, hold-back and events are the same as on the float32
path.

The interface is CompactLM's (decode, prefill): a KV slot is a llama.cpp sequence id, and
a row that starts before the end of its sequence's cache (a rollback, SAR) first removes
the positions past its start (`llama_memory_seq_rm`), as setting a slot's length does for
the slot KV cache.

Batch invariance, as on the float32 path: each sequence has a KV stream of its own
(`kv_unified` off), so its keys sit at the cells of their positions whatever the other
sequences hold, and llama.cpp computes each row of a weight matmul and each query's
attention on its own; a row's logits are then the same bits whatever else the step holds,
and a prompt fed in chunks gives the logits of a whole prefill (tests/integration/
test_model.py checks both).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from torch import Tensor

from finsieve.errors import ModelLoadError

from .kv_cache import Chunk

log = structlog.get_logger(__name__)

_LOG_ERROR = 4  # ggml_log_level GGML_LOG_LEVEL_ERROR


@functools.cache
def _llama() -> tuple[Any, Any]:
    """llama_cpp, its backend started and its log routed to ours (errors only: llama.cpp
    prints every tensor it loads), once; and the log callback, kept alive here."""
    try:
        import llama_cpp
    except ImportError as e:  # make setup installs it
        raise ModelLoadError("llama.cpp (llama-cpp-python) is not installed: run `make setup`, "
                             "or set FINSIEVE_CPU_BACKEND=float32") from e
    except (OSError, RuntimeError) as e:  # its shared library did not load (a missing libgomp)
        raise ModelLoadError(f"llama.cpp (llama-cpp-python) did not load: {e}; reinstall it "
                             "(make setup), or set FINSIEVE_CPU_BACKEND=float32") from e
    callback = llama_cpp.llama_log_callback(_route_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    return llama_cpp, callback


def _route_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level == _LOG_ERROR and text.strip():
        log.warning("llama.cpp", message=text.decode(errors="replace").strip())


class _Batch:
    """A llama_batch over numpy arrays of our own: a step's rows are written a column at a
    time, not a field per token through ctypes. One sequence id per token."""

    def __init__(self, llama: Any, size: int) -> None:
        self.token = np.zeros(size, np.int32)
        self.pos = np.zeros(size, np.int32)
        self.n_seq_id = np.ones(size, np.int32)
        self.seq = np.zeros(size, np.int32)
        self.logits = np.zeros(size, np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (int32_p * size)(*(ctypes.cast(base + 4 * i, int32_p) for i in range(size)))
        self.struct = llama.llama_batch(
            0, self.token.ctypes.data_as(int32_p), None, self.pos.ctypes.data_as(int32_p),
            self.n_seq_id.ctypes.data_as(int32_p), self._seq_ptrs,
            self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))

    def fill(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray,
             outputs: np.ndarray) -> None:
        n = tokens.size
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = tokens, positions, seqs, outputs
        self.struct.n_tokens = n


class LlamaCppModel:
    """A GGUF model on llama.cpp with one KV sequence per slot; CompactLM's interface."""

    def __init__(self, gguf: Path, n_slots: int, max_len: int, max_tokens: int,
                 threads: int) -> None:
        """max_tokens: the most tokens one call feeds (a prefill chunk, or a decode row per
        slot); threads: llama.cpp's compute threads."""
        llama = self._llama = _llama()[0]
        self.device = torch.device("cpu")
        self.n_slots = n_slots
        self.max_len = max_len
        model = llama.llama_model_load_from_file(str(gguf).encode(), llama.llama_model_default_params())
        if not model:
            raise ModelLoadError(f"{gguf}: llama.cpp could not load this GGUF file")
        params = llama.llama_context_default_params()
        params.n_seq_max = n_slots
        params.n_ctx = n_slots * max_len  # each sequence's stream: max_len cells (rounded up to 256)
        params.n_batch = max(max_tokens, n_slots)
        params.n_ubatch = min(params.n_batch, 512)
        # llama.cpp computes a one-token step on n_threads and a larger one on
        # n_threads_batch. One row is bound by reading the weights, not by compute: a thread
        # fewer costs it little (8.0 -> 9.5 ms on 2 cores) and leaves a core to the process's
        # own Python work (loop, rules, gRPC), which else preempts a spinning llama.cpp thread
        # (1 stream through gRPC: 87 against 77 tokens/s, measured). Rows and prompts, bound by
        # compute, get every thread (4 rows: 19.9 ms on 2 threads, 33.6 on 1).
        params.n_threads = max(1, threads - 1)
        params.n_threads_batch = threads
        params.kv_unified = False  # a KV stream per sequence: see the module's notes
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        ctx = llama.llama_init_from_model(model, params)
        if not ctx:
            llama.llama_model_free(model)
            raise ModelLoadError(f"{gguf}: llama.cpp could not make a context of {n_slots} "
                                 f"sequences of {max_len} positions")
        self._ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        self.vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
        self._batch = _Batch(llama, params.n_batch)
        self.max_tokens = params.n_batch
        self._finalizer = weakref.finalize(self, _free, llama, ctx, model)

    @torch.inference_mode()
    def decode(self, ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """One token per row: ids[i] at KV position positions[i] of slots[i] (one row a
        slot); (rows, vocab) logits."""
        where = positions.numpy()
        seqs = slots.numpy()
        for slot, position in zip(seqs.tolist(), where.tolist(), strict=True):
            self._forget(slot, position)
        return self._forward(ids.numpy(), where, seqs, np.ones(where.size, np.int8))

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk], sample: list[bool]) -> Tensor:
        """Feed each chunk's tokens at its positions (a call per max_tokens of them); logits
        after the last token of each chunk marked in `sample`, in order: (sampled chunks,
        vocab)."""
        out = []
        for (slot, start, tokens), sampled in zip(chunks, sample, strict=True):
            if not tokens:
                raise ValueError("a prefill chunk holds at least one token")
            self._forget(slot, start)
            end = start + len(tokens)
            for at in range(start, end, self.max_tokens):
                piece = tokens[at - start : at - start + self.max_tokens]
                n = len(piece)
                outputs = np.zeros(n, np.int8)
                outputs[-1] = sampled and at + n == end
                logits = self._forward(np.asarray(piece, np.int32), np.arange(at, at + n),
                                       np.full(n, slot), outputs)
            if sampled:
                out.append(logits)
        return torch.cat(out) if out else torch.empty(0, self.vocab_size)

    def _forget(self, slot: int, start: int) -> None:
        """The slot's cache keeps positions below start: a rollback since the last call."""
        if not 0 <= slot < self.n_slots:  # -1 would clear every slot; past the end aborts
            raise ValueError(f"slot {slot} is not one of {self.n_slots}")
        self._llama.llama_memory_seq_rm(self._memory, slot, start, -1)

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray,
                 outputs: np.ndarray) -> Tensor:
        n = tokens.size
        if not 0 < n <= self.max_tokens:
            raise ValueError(f"a call feeds 1 to {self.max_tokens} tokens, not {n}")
        if positions.max() >= self.max_len:
            raise ValueError(f"position {positions.max()} is past a slot's {self.max_len}")
        self._batch.fill(tokens, positions, seqs, outputs)
        status = self._llama.llama_decode(self._ctx, self._batch.struct)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        rows = int(np.count_nonzero(outputs))
        if not rows:
            return torch.empty(0, self.vocab_size)
        logits = np.ctypeslib.as_array(self._llama.llama_get_logits(self._ctx),
                                       shape=(rows, self.vocab_size))
        return torch.from_numpy(logits.copy())  # the buffer is llama.cpp's, reused next call

    def warm_up(self) -> None:
        """A decode on slot 0, then forgotten: a model llama.cpp cannot run fails at start-up."""
        self.decode(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long))
        self._forget(0, 0)


def requantize_q8_0(source: Path, target: Path, threads: int) -> None:
    """Write the GGUF's weights to target as Q8_0. llama.cpp's Q4_1 dot products are bound by
    compute on AVX2, a row at a time, with no kernel that shares a weight's unpacking among
    a batch's rows; Q8_0 batches run through llamafile's tinyBLAS. Measured on 2 EPYC cores
    (bench/bench_cpu.py's notes): the same one-row speed, 1.73x the tokens a step at 4 rows
    (Q4_1 1.48x), a prefill 2.3x faster. Q8_0 holds each Q4_1 value to within 1/254 of its
    block's largest, so the model stays the Q4_1 file's."""
    llama = _llama()[0]
    params = llama.llama_model_quantize_default_params()
    params.ftype = llama.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = threads
    if llama.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)):
        raise ModelLoadError(f"{source}: llama.cpp could not write it as Q8_0 to {target}")


def _free(llama: Any, ctx: Any, model: Any) -> None:
    llama.llama_free(ctx)
    llama.llama_model_free(model)
