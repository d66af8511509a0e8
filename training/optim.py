"""The optimizer and learning-rate schedule a config names (optax)."""

from __future__ import annotations

import optax

from training.config import Config


def make_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to the peak, then the config's decay (cosine, linear, constant or warmup-stable-decay)."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, cfg.steps)
    rest = max(cfg.steps - warmup, 1)
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(peak, end, rest)
    elif cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    else:  # wsd: stable at the peak, then a linear decay over the last decay_fraction of the steps
        decay = max(int(round(cfg.steps * cfg.decay_fraction)), 1)
        stable = max(rest - decay, 0)
        after = optax.join_schedules([optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay)], [stable])
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(cfg: Config, schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
    """Gradient clipping (when on), then the config's optimizer at the schedule's rate."""
    lr = schedule or make_schedule(cfg)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    if cfg.optimizer == "adamw":
        parts.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    elif cfg.optimizer == "lion":
        parts.append(optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
    elif cfg.optimizer == "adafactor":
        parts.append(optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None))
    else:
        parts.append(optax.sgd(lr, momentum=cfg.b1 or None))
    return optax.chain(*parts)
