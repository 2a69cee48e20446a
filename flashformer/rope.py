"""Rotary position embeddings and their context-extension scalings.

Scalings are configured like Hugging Face's ``rope_scaling`` / ``rope_parameters`` dict, e.g.
``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}`` (the legacy key
``"type"`` is accepted), and reproduce transformers' frequencies and attention factor:

* ``linear``: positions divided by ``factor`` (inverse frequencies divided by it).
* ``dynamic``: NTK-aware base growth once the sequence exceeds ``max_seq_len``.
* ``yarn``: per-frequency blend of interpolation and extrapolation, plus an attention factor
  (mscale) multiplying cos / sin.
* ``llama3``: Llama 3.1's piecewise rescaling of the low frequencies.
* ``longrope``: Phi-3's per-frequency divisors, ``short_factor`` up to the original context and
  ``long_factor`` for a sequence longer than it, plus an attention factor.

Layout: the "rotate_half" (non-interleaved) layout of Hugging Face Llama: dimension i pairs with
i + rotary_dim / 2, not with i + 1. Using it in our model means HF checkpoints load without permuting
the q / k projection rows. Partial rotary embeddings (Phi-4-mini's ``partial_rotary_factor`` 0.75) rotate
the first rotary_dim dims of each head and pass the rest through; every scaling then counts frequencies
over rotary_dim, not head_dim, as transformers does.
"""

from __future__ import annotations

import difflib
import math

import torch

# Keys each rope_type accepts; the first group is required (after defaults are filled in).
_ROPE_KEYS = {
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "yarn": ({"original_max_position_embeddings"},
             {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, set()),
    "longrope": ({"short_factor", "long_factor", "original_max_position_embeddings"}, {"factor", "attention_factor"}),
}
_FACTOR_LISTS = ("short_factor", "long_factor")  # one divisor per rotated pair


def normalize_rope_scaling(scaling: dict | None, max_seq_len: int, rotary_dim: int | None = None) -> dict | None:
    """Check a ``rope_scaling`` dict; return it with ``rope_type`` set and defaults filled in.

    Args:
        scaling: HF-style dict or None; ``{"rope_type": "default"}`` means no scaling.
        max_seq_len: the model's context length, the default ``original_max_position_embeddings``.
        rotary_dim: the rotated dims of a head; given, LongRoPE's factor lists must hold one entry per pair.
    Returns:
        A new dict (never the caller's), or None for unscaled RoPE.
    Raises:
        ValueError naming the offending ``rope_scaling.<key>``.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {scaling!r}")
    scaling = dict(scaling)
    legacy_type = scaling.pop("type", None)
    rope_type = scaling.pop("rope_type", legacy_type)
    # HF configs repeat rope_theta (our ModelConfig.rope_theta) inside the dict.
    scaling.pop("rope_theta", None)
    if "partial_rotary_factor" in scaling:
        raise ValueError("rope_scaling.partial_rotary_factor: set the model config's partial_rotary_factor instead "
                         "(how many dims rotate is not a scaling)")
    if rope_type in (None, "default"):
        if scaling:
            raise ValueError(f"rope_scaling: keys {sorted(scaling)} need a rope_type; supported: {sorted(_ROPE_KEYS)}")
        return None
    if rope_type not in _ROPE_KEYS:
        supported = ", ".join(map(repr, ["default", *_ROPE_KEYS]))
        raise ValueError(f"rope_scaling.rope_type={rope_type!r}: supported are {supported}")
    required, optional = _ROPE_KEYS[rope_type]
    if "original_max_position_embeddings" in required:
        scaling.setdefault("original_max_position_embeddings", max_seq_len)
    for key in scaling:
        if key not in required | optional:
            close = difflib.get_close_matches(key, sorted(required | optional), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"rope_scaling.{key} is not a parameter of rope_type {rope_type!r}{hint}")
    missing = sorted(required - set(scaling))
    if missing:
        raise ValueError(f"rope_scaling for rope_type {rope_type!r} is missing {', '.join(missing)}")
    for key, value in scaling.items():
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"rope_scaling.truncate must be a bool, got {value!r}")
        elif key in _FACTOR_LISTS:
            if not isinstance(value, (list, tuple)) or not value or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
                raise ValueError(f"rope_scaling.{key} must be a list of positive numbers, got {value!r}")
            if rotary_dim is not None and len(value) != rotary_dim // 2:
                raise ValueError(f"rope_scaling.{key} has {len(value)} entries; rotary_dim {rotary_dim} rotates "
                                 f"{rotary_dim // 2} pairs")
            scaling[key] = [float(x) for x in value]
        elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"rope_scaling.{key} must be a positive number, got {value!r}")
    if rope_type in ("linear", "dynamic", "llama3") and scaling["factor"] < 1:
        raise ValueError(f"rope_scaling.factor must be >= 1, got {scaling['factor']!r}")
    return {"rope_type": rope_type, **scaling}


def _rotation_periods(rotary_dim: int, theta: float) -> torch.Tensor:
    """theta ** (2i / rotary_dim) for i < rotary_dim / 2 (each pair's wavelength / 2 pi).

    fp32 on the CPU, explicitly, so that building a model under a meta device context still works.
    """
    return theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim)


def _base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / _rotation_periods(rotary_dim, theta)


def _yarn_inv_freq(rotary_dim, theta, scaling, max_seq_len):
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_seq_len / original
    # The number of full rotations a frequency makes over the original context decides whether it is
    # extrapolated (fast: > beta_fast rotations), interpolated (slow: < beta_slow) or blended linearly.
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_with_rotations(rotations):
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_with_rotations(beta_fast), dim_with_rotations(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    periods = _rotation_periods(rotary_dim, theta)
    inv_freq = 1.0 / (factor * periods) * (1 - extrapolate) + 1.0 / periods * extrapolate

    def mscale(scale, coefficient=1.0):
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(rotary_dim, theta, scaling):
    inv_freq = _base_inv_freq(rotary_dim, theta)
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than original / low_freq_factor are interpolated by `factor`, shorter than
    # original / high_freq_factor kept; those in between blend smoothly.
    scaled = torch.where(wavelen > original / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original / high_freq_factor) & (wavelen <= original / low_freq_factor)
    return torch.where(is_medium, blended, scaled)


def _longrope_inv_freq(rotary_dim, theta, scaling, max_seq_len, seq_len):
    original = scaling["original_max_position_embeddings"]
    name = "long_factor" if seq_len and seq_len > original else "short_factor"
    divisors = scaling[name]
    inv_freq = 1.0 / (torch.tensor(divisors, dtype=torch.float32, device="cpu") * _rotation_periods(rotary_dim, theta))
    # Phi-3 states its extension as max_position_embeddings over the original context.
    factor = scaling.get("factor") or max_seq_len / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention_factor)


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict | None, max_seq_len: int,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rotary_dim // 2,) fp32 on the CPU, and the factor multiplying cos / sin.

    Args:
        rotary_dim: the rotated dims of a head (even): head_dim, or fewer with a partial rotary factor.
        theta: RoPE base.
        scaling: a dict accepted by ``normalize_rope_scaling``, or None.
        max_seq_len: the model's context length (``max_position_embeddings`` in HF terms).
        seq_len: current sequence length; "dynamic" and "longrope" depend on it.
    """
    scaling = normalize_rope_scaling(scaling, max_seq_len, rotary_dim)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "linear":
        return _base_inv_freq(rotary_dim, theta) / scaling["factor"], 1.0
    if rope_type == "dynamic":
        factor = scaling["factor"]
        seq_len = max(seq_len or 0, max_seq_len)
        grown_theta = theta * (factor * seq_len / max_seq_len - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(rotary_dim, grown_theta), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling, max_seq_len)
    if rope_type == "llama3":
        return _llama3_inv_freq(rotary_dim, theta, scaling), 1.0
    if rope_type == "longrope":
        return _longrope_inv_freq(rotary_dim, theta, scaling, max_seq_len, seq_len)
    return _base_inv_freq(rotary_dim, theta), 1.0


class RotaryEmbedding:
    """cos / sin tables for given positions, computed in fp32.

    Deliberately not an nn.Module with buffers: ``model.to(torch.bfloat16)`` would cast them, and
    the frequencies must stay fp32. They are kept on the CPU and copied once per device.
    """

    def __init__(self, rotary_dim: int, theta: float, scaling: dict | None, max_seq_len: int):
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even for RoPE, got {rotary_dim}")
        self.rotary_dim, self.theta, self.max_seq_len = rotary_dim, theta, max_seq_len
        self.scaling = normalize_rope_scaling(scaling, max_seq_len, rotary_dim)
        rope_type = self.scaling["rope_type"] if self.scaling else "default"
        self.is_dynamic = rope_type == "dynamic"
        self.inv_freq, self.attention_factor = rope_frequencies(rotary_dim, theta, self.scaling, max_seq_len)
        # LongRoPE switches to its long factors for a whole call once a position passes the original
        # context, as transformers does (generation then re-encodes the sequence: sampling.py).
        self.long_from = self.scaling["original_max_position_embeddings"] if rope_type == "longrope" else None
        self.long_inv_freq = (None if self.long_from is None else
                              rope_frequencies(rotary_dim, theta, self.scaling, max_seq_len, self.long_from + 1)[0])
        self.reads_positions = self.is_dynamic or self.long_from is not None  # a host sync per call
        self._inv_freq_on = {}

    def _inv_freq(self, device, seq_len):
        if self.is_dynamic and seq_len > self.max_seq_len:
            return rope_frequencies(self.rotary_dim, self.theta, self.scaling, self.max_seq_len, seq_len)[0].to(device)
        is_long = self.long_from is not None and seq_len > self.long_from
        if (device, is_long) not in self._inv_freq_on:
            self._inv_freq_on[device, is_long] = (self.long_inv_freq if is_long else self.inv_freq).to(device)
        return self._inv_freq_on[device, is_long]

    def __call__(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: position_ids (batch, seqlen) int. Returns cos, sin: (batch, seqlen, rotary_dim) fp32."""
        # Only dynamic NTK and LongRoPE need the longest position (a host sync); the others are position-free.
        seq_len = int(position_ids.max()) + 1 if self.reads_positions else 0
        inv_freq = self._inv_freq(position_ids.device, seq_len)
        angles = position_ids.float()[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of ``x`` (batch, seqlen, heads, head_dim) by cos / sin
    (batch, seqlen, rotary_dim), in fp32; the other head_dim - rotary_dim dims pass through unchanged."""
    rotary_dim = cos.shape[-1]
    x_rotary = x[..., :rotary_dim].float()
    half = rotary_dim // 2
    rotated_half = torch.cat((-x_rotary[..., half:], x_rotary[..., :half]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = (x_rotary * cos + rotated_half * sin).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
