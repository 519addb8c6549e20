"""A compact Llama/Qwen2-family forward over the slot KV cache.

Weights, config and rotary tables come from the transformers model; the forward is ours,
so a step is visible in one screen. Each layer is two pure functions around the cache
write and attention: `attn_in` (residual add, RMSNorm, fused QKV matmul, bias; RoPE in
prefill, while decode's attention rotates q and k itself, in its kernel on CUDA) and
`attn_out` (output projection, residual add, RMSNorm, fused gate/up matmul, SiLU, down).
On CUDA each is compiled once with `torch.compile` (it fuses the elementwise work, but
for SiLU-and-multiply, a kernel of its own: activation.py; the same compiled code serves
every layer and batch size) and the decode step
is captured in CUDA graphs by the model runner. A single decoding row runs through GEMV
kernels instead (`_decode_one`, gemv.py): at one row the kernels' count, not the bytes,
was what was left above the bandwidth floor.

Batch invariance on the CPU: a sequence's logits must not depend on what else is in the
batch, or greedy answers (and so the response cache and audit trail) would change with
load. BLAS picks kernels and reduction orders by matrix shape, so decode runs every matmul
on fixed tiles of `row_tile` rows, prefill runs each chunk on its own, and attention
reads each sequence over exactly its own length. The same row then always meets the same
kernel, whatever the batch holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from . import gemv
from .activation import silu_mul
from .attention import (
    VarlenKeys,
    apply_rope,
    attention_kernel_available,
    chunk_tokens,
    decode_attention,
    prefill_attention,
    varlen_prefill,
)
from .kv_cache import Chunk, SlotKVCache
from .loader import HFModule

log = structlog.get_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class Layer:
    def __init__(self, hf_layer: HFModule, own: bool) -> None:
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.wqkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.bqkv = (
            torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            if attn.q_proj.bias is not None
            else None
        )
        self.wo = attn.o_proj.weight
        self.w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.w_down = mlp.down_proj.weight
        self.attn_norm = hf_layer.input_layernorm.weight
        self.mlp_norm = hf_layer.post_attention_layernorm.weight
        if own:  # the fused copies are the only ones used: free the originals
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                module.weight.data = torch.empty(0, device=self.wqkv.device, dtype=self.wqkv.dtype)


class CompactLM:
    def __init__(self, hf_model: HFModule, n_slots: int, max_len: int, row_tile: int = 0,
                 own_weights: bool = False, memory_fraction: float | None = None,
                 prefill_tokens: int = 2048, mixed_tokens: int = 0) -> None:
        cfg = hf_model.config
        inner = hf_model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.row_tile = row_tile
        self.embed = inner.embed_tokens.weight
        self.layers = [Layer(layer, own_weights) for layer in inner.layers]
        self.norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight
        param = self.embed
        self.device, self.dtype = param.device, param.dtype
        self.cos, self.sin = _rope_tables(inner.rotary_emb, max_len, self.device, self.dtype)
        # Prefill batches every chunk of a step into one forward on CUDA (throughput); on
        # the CPU each chunk runs alone (batch invariance).
        self.batch_prefill = self.device.type == "cuda"
        # ...and in one FlashAttention call per layer where it takes the dtype.
        self.varlen_prefill = self.batch_prefill and self.dtype in (torch.bfloat16, torch.float16)
        if memory_fraction is not None and self.device.type == "cuda":
            n_slots = self._slots_that_fit(n_slots, max_len, memory_fraction, prefill_tokens,
                                           mixed_tokens)
        self.cache = SlotKVCache(
            len(self.layers), n_slots, self.n_kv_heads, max_len, self.head_dim,
            self.dtype, self.device,
        )
        self.n_slots = n_slots
        self.attention_kernel = attention_kernel_available()  # decode_attention's Triton path
        self.chunk_tokens = chunk_tokens(self.n_heads // self.n_kv_heads)  # see chunk_groups
        # One row decodes through the GEMV kernels (gemv.py) where they take the shapes.
        self.gemv = (self.device.type == "cuda" and self.cos.shape[-1] == self.head_dim
                     and gemv.fits(cfg.hidden_size, self.layers[0].w_down.shape[1],
                                   self.n_heads, self.head_dim)
                     and all(w.is_contiguous() for layer in self.layers
                             for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)))
        # ...and the head, its final norm inside, where its tile takes the head's shape
        head = gemv.TILES["head"]
        self.gemv_head = (self.gemv and self.lm_head.is_contiguous()
                          and self.lm_head.shape[0] % head.block_n == 0
                          and gemv.block_k_for(self.lm_head.shape[1], head.block_k) > 0)
        # The split-K GEMVs' counters (zeros between launches), one set per projection
        self._o_counters, self._down_counters = (
            torch.zeros(cfg.hidden_size // gemv.TILES[name].block_n, dtype=torch.int32,
                        device=self.device) if self.gemv else None for name in ("o", "down"))
        self._eager = self._layer_parts(F.linear)
        self._tiled = self._layer_parts(self._tiled_linear) if row_tile else None
        self.set_compiled(False)

    def set_compiled(self, compiled: bool) -> None:
        """Compile the layer parts (CUDA): one compiled function per part serves every layer,
        batch size and prefill chunk (attn_in compiles twice: with RoPE for prefill, without
        for decode)."""
        parts = self._eager
        if compiled:
            attn_in, attn_out = parts
            parts = (torch.compile(attn_in, dynamic=True), torch.compile(attn_out, dynamic=True))
        self._prefill_in, self._prefill_out = parts
        self._decode_in, self._decode_out = self._tiled or parts

    def _slots_that_fit(self, wanted: int, max_len: int, fraction: float, prefill_tokens: int,
                        mixed_tokens: int) -> int:
        """KV slots in `fraction` of the device's memory, less what is used already and a
        reserve for activations: the decode graphs', a prefill step's of up to
        `prefill_tokens` tokens twice (the prefill graphs' pool keeps the largest bucket's;
        a step that fits no bucket runs eagerly beside it), and the mixed graphs' (their
        logits, kept per graph, and the largest bucket's activations)."""
        free, total = torch.cuda.mem_get_info(self.device)
        layer = self.layers[0]
        hidden, rows = layer.wo.shape[0], layer.wqkv.shape[0] + layer.w_gate_up.shape[0] * 3 // 2
        per_token = self.dtype.itemsize * (4 * hidden + rows) + 4 * hidden  # + a float32 norm
        # ...and a layer's gathered keys and values (a bucket's tokens plus a slot's positions)
        per_key = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        reserve = 2 * 1024**3 + 2 * (prefill_tokens * per_token + (prefill_tokens + max_len) * per_key)
        if mixed_tokens:  # each mixed graph keeps its logits; the largest bucket's activations
            graphs = wanted // 16 + mixed_tokens // 32 + 1
            splits = self.n_heads * -(-max_len // 64) * (self.head_dim + 1) * 4  # float32 partials
            reserve += graphs * wanted * self.vocab_size * self.dtype.itemsize
            reserve += (wanted + mixed_tokens) * (per_token + splits)
        per_slot = SlotKVCache.bytes_per_slot(len(self.layers), self.n_kv_heads, max_len,
                                              self.head_dim, self.dtype)
        budget = fraction * total - (total - free) - reserve
        fit = max(int(budget // per_slot) - 1, 0)  # one slot is the padding rows' scratch
        if fit < 1:
            raise MemoryError(f"no room for one KV slot of {max_len} positions "
                              f"({per_slot / 2**20:.0f} MiB): lower --max-context")
        if fit < wanted:
            log.warning("fewer KV slots than --max-batch fit in device memory",
                        wanted=wanted, fit=fit, gib_per_slot=round(per_slot / 2**30, 3))
        return min(wanted, fit)

    # -- the two entry points ---------------------------------------------------------

    @torch.inference_mode()
    def decode(self, ids: Tensor, positions: Tensor, slots: Tensor, heads: Tensor | None = None,
               groups: Tensor | None = None) -> Tensor:
        """One token per row: ids[i] at KV position positions[i] of slots[i]; (rows, vocab)
        logits, or only those of the rows `heads`.

        heads given, rows may share a slot: the tokens of prefill chunks, fed as rows beside
        the decode rows (a mixed step: the weights are read once for both, where a prefill
        forward of its own read them again), each attending to the keys the rows before it
        in its chunk bring; groups (attention.chunk_groups, by chunk_tokens): the rows that
        attend together, a chunk's reading their keys once."""
        return self.decode_embedded(self.embed[ids], positions, positions + 1, slots, heads, groups)

    @torch.inference_mode()
    def decode_embedded(self, x: Tensor, positions: Tensor, lengths: Tensor, slots: Tensor,
                        heads: Tensor | None = None, groups: Tensor | None = None) -> Tensor:
        """decode from the rows' embeddings x (rows, hidden) and lengths (positions + 1):
        the decode graphs gather both in one kernel of their own. x may be written over (the
        one-row path's residual stream): a fresh tensor, never a view of the embedding table."""
        if self.gemv and x.shape[0] == 1 and heads is None:
            return self._decode_one(x[0], positions, lengths, slots)
        delta = torch.zeros_like(x)
        # The attention rotates q and k (in its kernel on CUDA: no RoPE kernels of its own)
        rope = (self.cos, self.sin)
        for i, layer in enumerate(self.layers):
            x, q, k, v = self._decode_in(x, delta, layer.attn_norm, layer.wqkv, layer.bqkv,
                                         positions, False)
            attn = decode_attention(q, k, v, self.cache.k[i], self.cache.v[i], slots, lengths,
                                    self.attention_kernel, rope, shared=heads is not None,
                                    groups=groups)
            x, delta = self._decode_out(x, attn.flatten(1), layer.wo, layer.mlp_norm,
                                        layer.w_gate_up, layer.w_down)
        x = x + delta if heads is None else x[heads] + delta[heads]
        return self._head(x, self._tiled_linear if self.row_tile else F.linear)

    def _decode_one(self, x: Tensor, positions: Tensor, lengths: Tensor, slots: Tensor) -> Tensor:
        """decode for one row: GEMV kernels and the attention; x (hidden,), the residual
        stream, is updated in place."""
        nh, nkv, hd, eps = self.n_heads, self.n_kv_heads, self.head_dim, self.eps
        for i, layer in enumerate(self.layers):
            qkv = gemv.norm_qkv_rope(x, layer.attn_norm, eps, layer.wqkv, layer.bqkv,
                                     self.cos, self.sin, positions, (nh + nkv) * hd)
            q, k, v = qkv.view(1, -1, hd).split([nh, nkv, nkv], 1)
            attn = decode_attention(q, k, v, self.cache.k[i], self.cache.v[i], slots, lengths,
                                    self.attention_kernel)
            gemv.add_matmul(attn.view(-1), layer.wo, x, gemv.TILES["o"], self._o_counters)
            h = gemv.norm_gate_up_silu(x, layer.mlp_norm, eps, layer.w_gate_up)
            gemv.add_matmul(h, layer.w_down, x, gemv.TILES["down"], self._down_counters)
        if self.gemv_head:  # no norm kernels of its own, nor cuBLAS's GEMV (0.5% of a step)
            return gemv.norm_matmul(x, self.norm, eps, self.lm_head)[None]
        return self._head(x[None], F.linear)

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk], sample: list[bool]) -> Tensor:
        """Feed each chunk's tokens at its positions; logits after the last token of each
        chunk marked in `sample`, in order: (sampled chunks, vocab)."""
        if self.batch_prefill:
            return self._prefill(chunks, sample)
        outs = [self._prefill([c], [s]) for c, s in zip(chunks, sample, strict=True)]
        return torch.cat(outs) if outs else torch.empty(0, self.vocab_size, device=self.device)

    # -- pieces -----------------------------------------------------------------------

    def _prefill(self, chunks: list[Chunk], sample: list[bool]) -> Tensor:
        spans = [(slot, start, len(toks)) for slot, start, toks in chunks]
        ids, positions, slots, last, keys = self._prefill_inputs(chunks, sample, spans)
        return self.forward_prefill(ids, positions, slots, last, keys, spans)

    @torch.inference_mode()
    def forward_prefill(self, ids: Tensor, positions: Tensor, slots: Tensor, last: Tensor,
                        keys: VarlenKeys | None, spans: Sequence[tuple[int, int, int]] = ()
                        ) -> Tensor:
        """ids[i] at KV position positions[i] of slots[i]; logits after the tokens `last`.
        Attention: one varlen call over `keys`, else SDPA per span (slot, start, n)."""
        x = self.embed[ids]
        delta = torch.zeros_like(x)
        for i, layer in enumerate(self.layers):
            x, q, k, v = self._prefill_in(x, delta, layer.attn_norm, layer.wqkv, layer.bqkv,
                                          positions, True)
            self.cache.k[i][slots, :, positions] = k
            self.cache.v[i][slots, :, positions] = v
            attn = (varlen_prefill(q, self.cache.k[i], self.cache.v[i], keys) if keys is not None
                    else prefill_attention(q, self.cache.k[i], self.cache.v[i], spans))
            x, delta = self._prefill_out(x, attn.flatten(1), layer.wo, layer.mlp_norm,
                                         layer.w_gate_up, layer.w_down)
        return self._head(x[last] + delta[last], F.linear)

    def _prefill_inputs(self, chunks: list[Chunk], sample: list[bool],
                        spans: list[tuple[int, int, int]]) -> tuple:
        """The step's prefill indices: built on the host, copied to the device in one go.
        ids, positions and slots per token; the last token of each sampled chunk; the keys."""
        sizes = [n for _, _, n in spans]
        parts = prefill_arrays(chunks, sample)
        if self.varlen_prefill:
            parts += VarlenKeys.host_arrays(spans)
        flat = torch.from_numpy(np.concatenate(parts))
        if self.device.type == "cuda":  # pinned: the copy does not wait for the device
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        ids, positions, slots, last, *where = flat.split([part.size for part in parts])
        keys = None
        if where:
            key_slots, key_positions, cu_q, cu_k = where
            keys = VarlenKeys(key_slots, key_positions, cu_q.int(), cu_k.int(), max(sizes),
                              max(start + n for _, start, n in spans))
        return ids, positions, slots, last, keys

    def _head(self, x: Tensor, linear: Callable) -> Tensor:
        return linear(_rms_norm(x, self.norm, self.eps), self.lm_head)

    def _layer_parts(self, linear: Callable) -> tuple[Callable, Callable]:
        n_heads, n_kv, hd, eps = self.n_heads, self.n_kv_heads, self.head_dim, self.eps
        cos_table, sin_table = self.cos, self.sin

        def attn_in(x: Tensor, delta: Tensor, norm: Tensor, wqkv: Tensor, bqkv: Tensor | None,
                    positions: Tensor, rope: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            x = x + delta  # the previous layer's MLP output joins the residual stream here
            n = x.shape[0]
            qkv = linear(_rms_norm(x, norm, eps), wqkv)
            if bqkv is not None:
                qkv = qkv + bqkv
            q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], -1)
            q, k, v = q.view(n, n_heads, hd), k.view(n, n_kv, hd), v.view(n, n_kv, hd)
            if rope:
                cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            return x, q, k, v

        def attn_out(x: Tensor, attn: Tensor, wo: Tensor, norm: Tensor, w_gate_up: Tensor,
                     w_down: Tensor) -> tuple[Tensor, Tensor]:
            x = x + linear(attn, wo)
            return x, linear(silu_mul(linear(_rms_norm(x, norm, eps), w_gate_up)), w_down)

        return attn_in, attn_out

    def _tiled_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        tile = self.row_tile
        n = x.shape[0]
        padded = F.pad(x, (0, 0, 0, -n % tile))
        return torch.cat([F.linear(rows, weight) for rows in padded.split(tile)])[:n]


def prefill_arrays(chunks: list[Chunk], sample: list[bool]) -> list[np.ndarray]:
    """A prefill step's host arrays (int64): ids, positions and slots per token; the last
    token of each sampled chunk."""
    sizes = [len(toks) for _, _, toks in chunks]
    return [
        np.fromiter((t for _, _, toks in chunks for t in toks), dtype=np.int64, count=sum(sizes)),
        np.concatenate([np.zeros(0, np.int64),
                        *(np.arange(start, start + len(toks), dtype=np.int64) for _, start, toks in chunks)]),
        np.repeat(np.asarray([slot for slot, _, _ in chunks], dtype=np.int64), sizes),
        (np.cumsum(sizes, dtype=np.int64) - 1)[np.asarray(sample, dtype=bool)],
    ]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope_tables(rotary: HFModule, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin per position from the model's own rotary module (covers every rope_type)."""
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    scale = getattr(rotary, "attention_scaling", 1.0)
    freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
