"""A compact Llama/Qwen2-family forward over the slot KV cache.

Weights, config and rotary tables come from the transformers model; the forward is ours,
so the decode step is visible in one screen: fused QKV and gate/up matmuls, RoPE, SDPA
over each sequence's own cache length.

Batch invariance: a sequence's logits must not depend on what else is in the batch, or
greedy answers (and so the response cache and audit trail) would change with load. BLAS
picks kernels and reduction orders by matrix shape, so decode runs every matmul on fixed
tiles of `row_tile` rows and attends each sequence over exactly its own length. The same
row then always meets the same kernel, whatever the batch holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .kv_cache import SlotKVCache

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class Layer:
    def __init__(self, hf_layer: torch.nn.Module) -> None:
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


class CompactLM:
    """Forward passes of one Llama/Qwen2 model over a SlotKVCache it owns."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        n_slots: int,
        max_len: int,
        row_tile: int = 0,
    ) -> None:
        cfg = hf_model.config
        inner = hf_model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.row_tile = row_tile
        self.embed = inner.embed_tokens.weight
        self.layers = [Layer(layer) for layer in inner.layers]
        self.norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight
        param = self.embed
        self.device, self.dtype = param.device, param.dtype
        self.cos, self.sin = _rope_tables(inner.rotary_emb, max_len, self.device, self.dtype)
        self.cache = SlotKVCache(
            len(self.layers), n_slots, self.n_kv_heads, max_len, self.head_dim,
            self.dtype, self.device,
        )

    # -- the two entry points ---------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], slot: int) -> Tensor:
        """Append `token_ids` to `slot`'s context; return the logits after the last one."""
        start = self.cache.lengths[slot]
        n = len(token_ids)
        positions = torch.arange(start, start + n, device=self.device)
        x = self.embed[torch.tensor(token_ids, device=self.device)]
        # Causal over the new tokens, full view of what the slot already holds.
        mask = None
        if start > 0:
            key_pos = torch.arange(start + n, device=self.device)
            mask = key_pos[None, :] <= positions[:, None]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions, F.linear)
            self.cache.k[i, slot, :, start : start + n] = k.transpose(0, 1)
            self.cache.v[i, slot, :, start : start + n] = v.transpose(0, 1)
            keys = self.cache.k[i, slot, :, : start + n]
            values = self.cache.v[i, slot, :, : start + n]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )
            x = self._finish_layer(layer, x, out[0].transpose(0, 1).reshape(n, -1), F.linear)
        self.cache.lengths[slot] = start + n
        return F.linear(_rms_norm(x[-1:], self.norm, self.eps), self.lm_head)[0]

    @torch.inference_mode()
    def decode(self, token_ids: list[int], slots: list[int]) -> Tensor:
        """One step for a batch: token i goes to slots[i]; return (batch, vocab) logits."""
        b = len(token_ids)
        lengths = [self.cache.lengths[s] for s in slots]
        positions = torch.tensor(lengths, device=self.device)
        slot_idx = torch.tensor(slots, device=self.device)
        x = self.embed[torch.tensor(token_ids, device=self.device)]
        linear = self._tiled_linear if self.row_tile else F.linear
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions, linear)
            self.cache.k[i, slot_idx, :, positions] = k
            self.cache.v[i, slot_idx, :, positions] = v
            out = torch.empty_like(q)
            for row, (slot, length) in enumerate(zip(slots, lengths, strict=True)):
                out[row] = F.scaled_dot_product_attention(
                    q[row, :, None],
                    self.cache.k[i, slot, :, : length + 1],
                    self.cache.v[i, slot, :, : length + 1],
                    enable_gqa=True,
                )[:, 0]
            x = self._finish_layer(layer, x, out.reshape(b, -1), linear)
        for slot, length in zip(slots, lengths, strict=True):
            self.cache.lengths[slot] = length + 1
        return linear(_rms_norm(x, self.norm, self.eps), self.lm_head)

    # -- pieces -----------------------------------------------------------------------

    def _qkv(self, layer: Layer, x: Tensor, positions: Tensor, linear) -> tuple[Tensor, ...]:
        n = x.shape[0]
        qkv = linear(_rms_norm(x, layer.attn_norm, self.eps), layer.wqkv)
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv
        hd = self.head_dim
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], -1)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        q = _rope(q.view(n, self.n_heads, hd), cos, sin)
        k = _rope(k.view(n, self.n_kv_heads, hd), cos, sin)
        return q, k, v.view(n, self.n_kv_heads, hd)

    def _finish_layer(self, layer: Layer, x: Tensor, attn: Tensor, linear) -> Tensor:
        x = x + linear(attn, layer.wo)
        gate, up = linear(_rms_norm(x, layer.mlp_norm, self.eps), layer.w_gate_up).chunk(2, -1)
        return x + linear(F.silu(gate) * up, layer.w_down)

    def _tiled_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        tile = self.row_tile
        n = x.shape[0]
        padded = F.pad(x, (0, 0, 0, -n % tile))
        return torch.cat([F.linear(rows, weight) for rows in padded.split(tile)])[:n]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _rope_tables(rotary: torch.nn.Module, max_len: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos/sin per position from the model's own rotary module (covers every rope_type)."""
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    scale = getattr(rotary, "attention_scaling", 1.0)
    freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
