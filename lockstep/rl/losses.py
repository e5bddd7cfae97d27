"""Policy-gradient losses of the GRPO family: group advantages, the clipped surrogate, aggregation.

One recipe field, :attr:`LossConfig.kind`, picks the method; the other fields are its knobs.

- ``"grpo"`` -- DeepSeekMath (Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
  Reasoning in Open Language Models", eq. 3 and section 4.1.2). Advantage ``(r - mean) / (std + eps)``
  within each group of samples of one prompt; the loss is the mean over each sequence's response
  tokens, then the mean over sequences. ``std`` is the **unbiased** (Bessel-corrected, ``n - 1``)
  standard deviation, ``torch.std``'s default, as in TRL's ``GRPOTrainer`` and verl's GRPO
  advantage estimator (the paper does not say which).
- ``"dapo"`` -- DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
  Scale"). GRPO's advantage; the loss is the token-level mean: the sum over every response token in
  the batch divided by the number of those tokens, so a long response weighs in per token rather
  than per sequence. The paper's other pieces are separate fields: "clip-higher" is
  ``clip_high > clip_low`` (the paper uses 0.2 / 0.28), dynamic sampling is
  ``filter_zero_variance_groups=True``, and it drops the KL term (``kl_coef=0``).
- ``"dr_grpo"`` -- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective"). Advantage ``r - mean`` (no division by the std, which up-weights near-uniform
  groups), and the loss is the sum over tokens divided by ``n_sequences * max_response_length``, a
  constant that does not depend on how long the sampled responses are (no length bias).

The per-token term (all kinds) is PPO's clipped surrogate plus an optional KL penalty::

    ratio   = exp(logp - old_logp)                    # old_logp: the policy at rollout time
    pg      = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    pg      = pg * min(exp(old_logp - generator_logp), tis_cap)     # only when tis_cap > 0
    k3      = exp(ref_logp - logp) - (ref_logp - logp) - 1          # Schulman's k3 estimator
    loss_t  = pg + kl_coef * k3

``old_logp`` is the trainer's log-probability of each sampled token under the weights that produced
the rollout; in the synchronous on-policy case it is ``logp.detach()`` (the default), so the ratio is
1 and the loss's gradient is the plain policy gradient. The truncated importance-sampling (TIS)
weight corrects for the generator (an inference engine) sampling from a slightly different
distribution than the trainer scores (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training"; TRL's ``vllm_importance_sampling_correction``): it multiplies the
policy-gradient term only, as TRL does, and is detached. The KL is to a frozen reference policy
(DeepSeekMath eq. 4); its gradient is ``1 - exp(ref_logp - logp)`` per token.

Every input except ``logp`` is detached: the loss is differentiable with respect to ``logp`` only.
Inputs are padded ``[B, T]`` tensors with a 0/1 ``mask`` of the tokens that count (response tokens;
prompt, padding and tool-reply tokens are 0). Masked positions are replaced before any arithmetic,
so padding may hold anything (``-inf``, NaN) without reaching the loss or its gradient.

Sequences are group-major: sequence ``b`` is sample ``b % group_size`` of group ``b // group_size``
(:meth:`PolicyLoss.advantages` flattens ``[n_groups, group_size]`` in that order).
"""

from __future__ import annotations

import dataclasses

import torch

from lockstep.config.base import Config, require, require_choice

KINDS = ["grpo", "dapo", "dr_grpo"]

#: which advantage each kind uses: divide by the group's std or not
_SCALES_BY_STD = {"grpo": True, "dapo": True, "dr_grpo": False}


@dataclasses.dataclass(kw_only=True)
class LossConfig(Config):
    """The RL policy loss: which GRPO-family method, its clip range, KL and off-policy correction."""

    #: "grpo" (per-sequence mean, std-scaled advantage), "dapo" (token-level mean), "dr_grpo"
    #: (sum / (sequences * max_response_length), advantage not scaled by the std)
    kind: str = "grpo"
    #: lower clip range: the ratio is clipped below at 1 - clip_low
    clip_low: float = 0.2
    #: upper clip range: the ratio is clipped above at 1 + clip_high (DAPO "clip-higher": 0.28)
    clip_high: float = 0.2
    #: weight of the k3 KL to a frozen reference policy (0: no KL term, no reference needed)
    kl_coef: float = 0.0
    #: cap of the truncated importance weight exp(old_logp - generator_logp); 0 disables it
    tis_cap: float = 0.0
    #: DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal)
    filter_zero_variance_groups: bool = False
    #: added to the group std before dividing ("grpo", "dapo")
    adv_eps: float = 1e-6

    def validate(self, path: str = "loss") -> None:
        require_choice(self.kind, KINDS, f"{path}.kind")
        require(0 <= self.clip_low < 1, f"{path}.clip_low",
                f"must be in [0, 1) (the ratio's lower bound 1 - clip_low must stay > 0), got {self.clip_low}")
        require(self.clip_high >= 0, f"{path}.clip_high", f"must be >= 0, got {self.clip_high}")
        require(self.kl_coef >= 0, f"{path}.kl_coef", f"must be >= 0, got {self.kl_coef}")
        require(self.tis_cap == 0 or self.tis_cap >= 1, f"{path}.tis_cap",
                f"must be 0 (off) or >= 1 (a cap below 1 would scale down every on-policy token), "
                f"got {self.tis_cap}")
        require(self.adv_eps >= 0, f"{path}.adv_eps", f"must be >= 0, got {self.adv_eps}")

    def build(self, *, max_response_length: int | None = None) -> "PolicyLoss":
        """The loss object. ``max_response_length`` (the sampler's max new tokens) is the constant
        normaliser of "dr_grpo" and is required for it; the other kinds ignore it."""
        self.validate()
        return PolicyLoss(self, max_response_length=max_response_length)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[n_groups]`` bool: True where every reward of the group equals the first (exact compare:
    verifier rewards are discrete, and a tolerance would be a second knob)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def group_advantages(rewards: torch.Tensor, kind: str = "grpo", *, eps: float = 1e-6,
                     filter_zero_variance: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample advantages ``[n_groups, group_size]`` and the ``[n_groups]`` bool mask of groups kept.

    "grpo" / "dapo": ``(r - mean) / (std + eps)`` with the unbiased std (``torch.std``, ``n - 1``),
    so groups need at least 2 samples. "dr_grpo": ``r - mean``. A group whose rewards are all equal
    gets advantage exactly 0 (not ``rounding error / eps``); with ``filter_zero_variance`` it is also
    marked not kept (DAPO dynamic sampling), otherwise every group is kept. Integer or bool rewards
    are converted to the default float dtype.
    """
    require_choice(kind, KINDS, "group_advantages: kind")
    if rewards.ndim != 2:
        raise ValueError(f"group_advantages: rewards: expected [n_groups, group_size], got shape "
                         f"{tuple(rewards.shape)}")
    scale = _SCALES_BY_STD[kind]
    if scale and rewards.shape[1] < 2:
        raise ValueError(f"group_advantages: rewards: kind {kind!r} divides by the unbiased std, which "
                         f"needs group_size >= 2, got {rewards.shape[1]}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    rewards = rewards.detach()
    flat = zero_variance_groups(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    adv = centred / (rewards.std(dim=1, keepdim=True) + eps) if scale else centred
    adv = torch.where(flat[:, None], torch.zeros_like(adv), adv)
    kept = ~flat if filter_zero_variance else torch.ones_like(flat)
    return adv, kept


class PolicyLoss:
    """The configured loss: ``loss(logp, mask, advantages, ...) -> (scalar, metrics)``."""

    def __init__(self, config: LossConfig, *, max_response_length: int | None = None) -> None:
        if config.kind == "dr_grpo":
            if max_response_length is None or max_response_length < 1:
                raise ValueError(f"PolicyLoss: max_response_length: kind 'dr_grpo' normalises by "
                                 f"n_sequences * max_response_length and needs it >= 1, got "
                                 f"{max_response_length!r}")
        self.config = config
        self.max_response_length = max_response_length

    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """From ``[n_groups, group_size]`` rewards: per-sequence advantages ``[B]``, the per-sequence
        ``keep`` mask ``[B]`` (pass both to the loss) and metrics (``n_groups``, ``n_groups_kept``,
        ``reward_mean``), with ``B = n_groups * group_size`` in group-major order."""
        cfg = self.config
        adv, kept = group_advantages(rewards, cfg.kind, eps=cfg.adv_eps,
                                     filter_zero_variance=cfg.filter_zero_variance_groups)
        group_size = rewards.shape[1]
        metrics = {"n_groups": torch.tensor(rewards.shape[0]), "n_groups_kept": kept.sum(),
                   "reward_mean": rewards.detach().float().mean()}
        return adv.reshape(-1), kept.repeat_interleave(group_size), metrics

    def __call__(self, logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
                 old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                 generator_logp: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                 normaliser: float | torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scalar loss and metrics (detached 0-dim tensors; no host sync).

        ``logp``: ``[B, T]`` the trainer's log-probabilities of the sampled tokens (with grad).
        ``mask``: ``[B, T]`` 0/1 (bool or float), the tokens that count. ``advantages``: ``[B]``
        per sequence or ``[B, T]`` per token. ``old_logp``: ``[B, T]`` at rollout time (default:
        ``logp.detach()``, on-policy). ``ref_logp``: ``[B, T]`` the reference policy's, needed when
        ``kl_coef > 0`` (and reported as the ``kl`` metric whenever given). ``generator_logp``:
        ``[B, T]`` the engine's, needed when ``tis_cap > 0``. ``keep``: ``[B]`` bool, sequences to
        count (from :meth:`advantages`); dropped ones get no gradient and leave every denominator.
        ``normaliser``: replaces this batch's denominator (sequences kept for "grpo", tokens for
        "dapo", sequences kept * max_response_length for "dr_grpo") with a global one, so that
        micro-batches or data-parallel ranks summing their losses reproduce the full-batch loss.
        A denominator below 1 is taken as 1, so a batch with nothing to count gives loss 0, not NaN.
        """
        cfg = self.config
        if logp.ndim != 2:
            raise ValueError(f"PolicyLoss: logp: expected [B, T], got shape {tuple(logp.shape)}")
        batch = logp.shape[0]
        _check_shape("mask", mask, logp.shape)
        for name, value in (("old_logp", old_logp), ("ref_logp", ref_logp), ("generator_logp", generator_logp)):
            if value is not None:
                _check_shape(name, value, logp.shape)
        if advantages.shape not in (torch.Size([batch]), logp.shape):
            raise ValueError(f"PolicyLoss: advantages: expected [{batch}] or {list(logp.shape)}, got "
                             f"shape {tuple(advantages.shape)}")
        if keep is not None:
            _check_shape("keep", keep, torch.Size([batch]))
        if isinstance(normaliser, (int, float)) and not normaliser > 0:
            raise ValueError(f"PolicyLoss: normaliser: must be > 0, got {normaliser!r}")
        if cfg.kl_coef > 0 and ref_logp is None:
            raise ValueError(f"PolicyLoss: ref_logp: required when kl_coef > 0 (kl_coef={cfg.kl_coef})")
        if cfg.tis_cap > 0 and generator_logp is None:
            raise ValueError(f"PolicyLoss: generator_logp: required when tis_cap > 0 (tis_cap={cfg.tis_cap})")

        m = mask.bool()
        if keep is not None:
            m = m & keep.bool()[:, None]
        w = m.to(logp.dtype)
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        # padding may hold -inf / NaN: select before any arithmetic so neither value nor grad sees it
        logp_m = torch.where(m, logp, zero)
        old = logp_m.detach() if old_logp is None else torch.where(m, old_logp.detach().to(logp.dtype), zero)
        adv = advantages.detach().to(logp.dtype)
        adv = adv[:, None].expand_as(logp) if adv.ndim == 1 else adv
        adv = torch.where(m, adv, zero)

        ratio = torch.exp(logp_m - old)
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        pg = -torch.minimum(ratio * adv, clipped * adv)
        per_token = pg
        tis = None
        if cfg.tis_cap > 0:
            gen = torch.where(m, generator_logp.detach().to(logp.dtype), zero)
            tis = torch.exp(old - gen).clamp(max=cfg.tis_cap)
            per_token = per_token * tis
        pg_terms = per_token
        k3 = None
        if ref_logp is not None:
            d = torch.where(m, ref_logp.detach().to(logp.dtype), zero) - logp_m
            k3 = torch.exp(d) - d - 1
            if cfg.kl_coef > 0:
                per_token = per_token + cfg.kl_coef * k3

        n_tokens = w.sum()
        n_seqs = (keep.bool().sum() if keep is not None else torch.tensor(batch)).to(logp.device, logp.dtype)
        loss, denominator = self._aggregate(per_token, w, n_seqs, normaliser)
        pg_loss, _ = self._aggregate(pg_terms, w, n_seqs, normaliser)

        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return ((x * w).sum() / n_tokens.clamp(min=1)).detach()

        with torch.no_grad():
            low = (ratio < 1 - cfg.clip_low) & (adv < 0) & m
            high = (ratio > 1 + cfg.clip_high) & (adv > 0) & m
            metrics = {
                "pg_loss": pg_loss.detach(),
                "clip_fraction": token_mean((low | high).to(logp.dtype)),
                "clip_fraction_low": token_mean(low.to(logp.dtype)),
                "clip_fraction_high": token_mean(high.to(logp.dtype)),
                "ratio_mean": token_mean(ratio),
                "ratio_max": torch.where(m, ratio, zero).max() if m.numel() else zero,
                "n_tokens": n_tokens.detach(),
                "n_sequences": n_seqs.detach(),
                "denominator": denominator.detach(),
            }
            if k3 is not None:
                metrics["kl"] = token_mean(k3)
            if tis is not None:
                metrics["tis_weight_mean"] = token_mean(tis)
                metrics["tis_capped_fraction"] = token_mean((tis >= cfg.tis_cap).to(logp.dtype))
        return loss, metrics

    def _aggregate(self, per_token: torch.Tensor, w: torch.Tensor, n_seqs: torch.Tensor,
                   normaliser: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(numerator / denominator, denominator) by the kind's rule; empty batches give 0, not NaN."""
        kind = self.config.kind
        if kind == "grpo":
            numerator = ((per_token * w).sum(dim=1) / w.sum(dim=1).clamp(min=1)).sum()
            denominator = n_seqs
        elif kind == "dapo":
            numerator = (per_token * w).sum()
            denominator = w.sum()
        else:  # dr_grpo
            numerator = (per_token * w).sum()
            denominator = n_seqs * self.max_response_length
        if normaliser is not None:
            denominator = torch.as_tensor(normaliser, dtype=per_token.dtype, device=per_token.device)
        denominator = denominator.to(device=per_token.device, dtype=per_token.dtype)
        return numerator / denominator.clamp(min=1), denominator


def _check_shape(name: str, value: torch.Tensor, shape: torch.Size) -> None:
    if value.shape != shape:
        raise ValueError(f"PolicyLoss: {name}: expected shape {list(shape)}, got {tuple(value.shape)}")
