"""The one factory through which every projection is built, so ``use_bitnet`` reaches all of them."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module


class BitLinear(nn.Linear):
    """BitNet b1.58 linear layer: ternary weights {-1, 0, +1} scaled by mean |W|, activations
    normalized over the feature dimension (RMS, no parameters) and quantized to 8 bits per token
    (absmax). Full-precision latent weights are trained through a straight-through estimator,
    so the optimizer sees ordinary gradients. Every statistic is per token: nothing mixes
    positions, so a causal model stays causal."""

    eps = 1e-5

    def quantized_weight(self) -> torch.Tensor:
        w = self.weight
        scale = w.abs().mean().clamp(min=self.eps)
        return (w / scale).round().clamp(-1, 1) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + (self.quantized_weight() - self.weight).detach()
        x = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=self.eps)
        xq = (x * scale).round().clamp(-128, 127) / scale
        x = x + (xq - x).detach()
        return F.linear(x, w, self.bias)


def stacked_linear(owner: nn.Module, x: torch.Tensor, linears: Sequence[nn.Module],
                   kept: MutableMapping) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``, as one matrix product when nothing is lost by it.

    Several projections of the same input (a mixer's q, k, v, gate, ...) cost one dispatch and
    one read of the input each; with autograd off (decoding) they are computed as one
    ``F.linear`` with their weights stacked, a copy kept in ``kept[owner]`` (the caller's
    store: a decoding state's, so the copies go with the state; never the model's own state
    or a process-wide table) and rebuilt when any weight or bias is replaced or changed in
    place (its version counter moves).

    Why the projections are not one module built fused: they stay separate modules so that
    adapters (PEFT's LoRA targets ``q_proj``, ``v_proj`` by name), BitLinear (a ternary scale
    per matrix) and every saved checkpoint see them as trained; only decoding, where each
    product is one token long and its dispatch is most of its cost, reads them stacked.
    Each module is
    called as itself instead when gradients are recorded, under ``torch.compile`` (which
    builds its own graph), or when one of them is not a plain ``nn.Linear`` with no hooks
    (BitLinear, a PEFT adapter, a user's hook) or holds an inference tensor (no version
    counter to see changes by), and when their weights together exceed ``STACK_MAX_ELEMENTS``."""
    stacked = _stacked_weights(owner, linears, kept) if _stackable(linears) else None
    if stacked is None:
        return tuple(m(x) for m in linears)
    weight, bias, sizes = stacked
    return F.linear(x, weight, bias).split(sizes, dim=-1)


def linear_rows(linear: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``linear(x)[..., start:stop]``: the outputs of a fused projection's rows ``start`` to
    ``stop`` (the queries of a fused q/k/v) computed alone when ``linear`` is a plain
    ``nn.Linear`` without hooks; any other module (BitLinear, whose scale reads the whole
    matrix; a PEFT adapter; a hook) is called whole and sliced."""
    if type(linear) is nn.Linear and not linear._forward_hooks and not linear._forward_pre_hooks \
            and not _module._global_forward_hooks and not _module._global_forward_pre_hooks:
        bias = linear.bias[start:stop] if linear.bias is not None else None
        return F.linear(x, linear.weight[start:stop], bias)
    return linear(x)[..., start:stop]


# Stack only projections this small (elements of all their weights together: 16 MB in
# float32). Past it a product is long enough that its own dispatch is a small share of its time,
# while the stacked copy would add real memory (a wide model's attention weights, twice).
STACK_MAX_ELEMENTS = 1 << 22


def _stackable(linears: Sequence[nn.Module]) -> bool:
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    if not all(type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks
               for m in linears):
        return False
    # plain tensors only: not inference tensors (no version counter), not a subclass such as
    # FSDP2's DTensor (sharded; its local data changes under it)
    return (sum(m.weight.numel() for m in linears) <= STACK_MAX_ELEMENTS
            and all(type(t.data) is torch.Tensor and not t.is_inference()
                    for m in linears for t in (m.weight, m.bias) if t is not None))


def tensor_state(t: torch.Tensor) -> tuple:
    """What tells a tensor's contents apart from before without reading them: its version
    counter (-1 for an inference tensor, which has none), address, dtype, device and shape.
    A tensor's data can be swapped without a version change (``module.to(dtype)`` sets
    ``.data``), hence the address and the rest."""
    return (-1 if t.is_inference() else t._version, t.data_ptr(), t.dtype, t.device,
            tuple(t.shape))


def _stacked_weights(owner: nn.Module, linears: Sequence[nn.Module], store: MutableMapping):
    tensors = [t for m in linears for t in (m.weight, m.bias)]
    # the data stacked from is held (kept[2]) so that no later data can take over its address
    # while the copy is kept
    versions = [tensor_state(t) if t is not None else None for t in tensors]
    kept = store.get(owner)
    if (kept is not None and len(kept[0]) == len(tensors)
            and all(a is b for a, b in zip(kept[0], tensors)) and kept[1] == versions):
        return kept[3]
    weights = [m.weight for m in linears]
    if len({(w.dtype, w.device) for w in weights}) > 1:
        return None  # mixed dtypes or devices: each product as itself
    # a normal tensor even when first built inside inference mode: it is kept across calls
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat(weights)
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias if m.bias is not None
                              else m.weight.new_zeros(m.out_features) for m in linears])
        held = [t.detach() for t in tensors if t is not None]
    stacked = (weight, bias, [m.out_features for m in linears])
    # owner -> (the weights and biases stacked from, their versions and addresses, their
    # data, (stacked weight, stacked bias, sizes))
    store[owner] = (tensors, versions, held, stacked)
    return stacked


def ternary_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Inference export: for every BitLinear, its weight as int8 in {-1, 0, 1} (``NAME.weight``)
    and the float scale (``NAME.weight_scale``); other tensors are left out. Save the result
    with ``safetensors.torch.save_file``."""
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, BitLinear):
            with torch.no_grad():
                scale = m.weight.abs().mean().clamp(min=m.eps)
                out[f"{name}.weight"] = (m.weight / scale).round().clamp(-1, 1).to(torch.int8)
                out[f"{name}.weight_scale"] = scale.reshape(1).float()
    return out


def make_linear(in_features: int, out_features: int, cfg, bias: bool | None = None) -> nn.Linear:
    """A linear layer honoring ``cfg.use_bitnet`` and ``cfg.bias``."""
    bias = cfg.bias if bias is None else bias
    klass = BitLinear if cfg.use_bitnet else nn.Linear
    return klass(in_features, out_features, bias=bias)
