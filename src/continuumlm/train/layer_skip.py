"""LayerSkip's training recipe for a discrete stack ([train.layer_skip],
config/layer_skip.py): layer dropout rising with depth, set on the stack for the run, and an
early-exit loss, the cross-entropy of each exit layer's output through the model's own final
norm and head; optionally (``exit_kl``) a KL term toward the whole stack's own distribution.
They serve ``--draft-layers``: the first layers learn to predict what the whole stack predicts,
and the later layers to refine rather than rewrite."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class LayerSkip:
    def __init__(self, model, t):
        self.model = model
        cfg = t.layer_skip
        self.enabled = cfg.enabled
        layers = model.config.num_layers
        self.exits = cfg.exits(layers) if self.enabled else []
        self.weight = float(cfg.exit_weight)
        self.kl_weight = float(cfg.exit_kl)
        total = sum(self.exits)
        self.exit_share = [n / total for n in self.exits]  # deeper exits weigh more
        if self.enabled and cfg.dropout > 0:
            model.depth.layer_drop = [cfg.dropout * i / (layers - 1) for i in range(layers)]

    @contextlib.contextmanager
    def recording(self):
        """Yields the list that receives each layer's output in the forward run inside the
        block (empty when no exit is trained)."""
        outputs: list[torch.Tensor] = []
        if not self.exits:
            yield outputs
            return
        self.model.depth.record = outputs
        try:
            yield outputs
        finally:
            self.model.depth.record = None

    def exit_loss(self, outputs: list[torch.Tensor], targets: torch.Tensor
                  ) -> torch.Tensor | None:
        """The depth-weighted mean over the exits of the cross-entropy of ``outputs[n - 1]``
        (the first n layers' output) through the final norm and head, at the targets that
        are not -1; None when no exit is trained."""
        if not self.exits:
            return None
        if len(outputs) != self.model.config.num_layers:
            raise RuntimeError(f"train.layer_skip: the forward recorded {len(outputs)} layer "
                               f"outputs, not one per layer ({self.model.config.num_layers}); "
                               f"the model's depth module did not run as a discrete stack.")
        keep = targets >= 0
        loss = 0.0
        for n, share in zip(self.exits, self.exit_share):
            logits = _wide(self.model.lm_head(self.model.norm_f(outputs[n - 1][keep])))
            loss = loss + share * F.cross_entropy(logits, targets[keep])
        return loss

    def exit_kl(self, outputs: list[torch.Tensor], logits: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor | None:
        """The depth-weighted mean over the exits of KL(stack || exit): the whole stack's
        next-token distribution (``logits``, detached) against each exit's, through the final
        norm and head, averaged over the positions whose targets are not -1; None without
        exit_kl (``outputs`` as :meth:`exit_loss` reads them; ``logits`` (B, T, V), or a
        task's logits at those positions alone, (N, V), as ``targets_only`` gives them)."""
        if not (self.exits and self.kl_weight > 0):
            return None
        keep = targets >= 0
        own = logits.detach() if logits.dim() == 2 else logits[keep].detach()
        own = F.log_softmax(_wide(own), dim=-1)
        kl = 0.0
        for n, share in zip(self.exits, self.exit_share):
            exit_logits = _wide(self.model.lm_head(self.model.norm_f(outputs[n - 1][keep])))
            kl = kl + share * F.kl_div(F.log_softmax(exit_logits, dim=-1), own,
                                       log_target=True, reduction="batchmean")
        return kl


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32, as the model's own loss takes them."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
