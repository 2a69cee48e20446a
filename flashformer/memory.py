"""What one training step holds in memory, estimated from the config before anything is allocated.

    plan = memory_plan(config, tokens=131072, lora=LoRAConfig(rank=16), activation_checkpointing="offload")
    print(format_plan(plan))

The state (weights, gradients, AdamW moments) is counted exactly. Activations are an estimate per token:
with checkpointing, the saved block inputs (the residual stream, on the host with "offload") plus one
block recomputed in backward together with its gradients; without it, every block's saved tensors.
The LM head runs chunked (losses.lm_head_loss), so it adds one chunk of logits, not tokens x vocab.
"""

from __future__ import annotations

from .lora import LoRAConfig
from .losses import CHUNK_LOGITS_ELEMENTS
from .model_config import ModelConfig

FP32, BF16 = 4, 2
ADAMW_MOMENTS = 2


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of a block's Linears, by LoRA target name."""
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    shapes = {"q": (config.d_model, q), "k": (config.d_model, kv), "v": (config.d_model, kv), "o": (q, config.d_model),
              "up": (config.d_model, config.d_ff), "down": (config.d_ff, config.d_model)}
    if config.mlp != "gelu":
        shapes["gate"] = (config.d_model, config.d_ff)
    return shapes


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a Transformer of ``config`` (norm weights and biases included)."""
    shapes = linear_shapes(config)
    matrices = sum(i * o for i, o in shapes.values())
    biases = 0
    if config.qkv_bias:
        biases += sum(shapes[t][1] for t in ("q", "k", "v"))
    if config.o_bias:
        biases += config.d_model
    if config.mlp_bias:
        biases += sum(shapes[t][1] for t in ("gate", "up", "down") if t in shapes)
    norms = (2 if config.norm_placement in ("pre", "post") else 4) * config.d_model
    if config.qk_norm == "per_head":
        norms += 2 * config.head_dim
    elif config.qk_norm == "across_heads":
        norms += shapes["q"][1] + shapes["k"][1]
    norms += config.d_model / config.n_layer  # the final norm, shared out over the blocks
    per_norm = 2 if config.norm == "layernorm" else 1  # weight and bias
    embeddings = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
    if config.pos == "learned":
        embeddings += config.max_seq_len * config.d_model
    return round(config.n_layer * (matrices + biases + per_norm * norms)) + embeddings


def adapter_count(config: ModelConfig, lora: LoRAConfig) -> int:
    """LoRA's A and B parameters over all blocks (norms not included)."""
    shapes = linear_shapes(config)
    return config.n_layer * sum(lora.rank * (shapes[t][0] + shapes[t][1]) for t in lora.targets)


def block_activation_bytes_per_token(config: ModelConfig, residual_bytes: int, activation_bytes: int = BF16,
                                     lora: LoRAConfig | None = None) -> int:
    """Bytes one block saves for backward per token (what autograd keeps; tests/test_bench_scripts.py
    counts them on a real block).

    Args:
        config: the model.
        residual_bytes: element size of the residual stream (the embedding's dtype).
        activation_bytes: element size of the matmuls' outputs (2 under bf16 autocast).
        lora: an enabled LoRAConfig: frozen Linears keep no inputs, only those an adapter reads.
    """
    adapted = lora is not None and lora.enabled
    d, a = config.d_model, activation_bytes
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    norm_count = 4 if config.norm_placement == "both" else 2
    norm_trains = not adapted or lora.train_norms
    # Each norm keeps its fp32 input and 1 / rms, plus its fp32 normalized input when its weight trains.
    norms = norm_count * (FP32 * d * (2 if norm_trains else 1) + FP32)
    if residual_bytes == FP32:  # the first norm's fp32 input is then the block input itself, counted apart
        norms -= FP32 * d
    # q, k, v and the output (o_proj reads a view of it), and the logsumexp per head.
    attention = a * (2 * q + 2 * kv) + FP32 * config.n_head
    gated = config.mlp != "gelu"
    hidden = a * config.d_ff * (3 if gated else 1)  # gate, act(gate), up; or the pre-activation

    def saved_inputs(targets, width: int) -> int:
        """A Linear keeps its input when its weight trains or an adapter reads it; from an fp32 residual
        autocast makes each Linear its own bf16 copy, from a bf16 one they share the tensor."""
        readers = [t for t in targets if not adapted or t in lora.targets]
        if not readers:
            return 0
        return (1 if residual_bytes == a else len(readers)) * a * width

    inputs = (saved_inputs(("q", "k", "v"), d) + saved_inputs(("gate", "up") if gated else ("up",), d)
              + saved_inputs(("down",), config.d_ff))
    adapters = a * lora.rank * len(lora.targets) if adapted else 0  # A's output, which B reads
    return norms + attention + hidden + inputs + adapters


def memory_plan(config: ModelConfig, tokens: int, lora: LoRAConfig | None = None,
                activation_checkpointing: bool | str = True, bf16_autocast: bool = True) -> dict:
    """Bytes of one training step of ``tokens`` tokens (batch x seq_len) on one device.

    Args:
        config: the model.
        tokens: tokens per micro batch.
        lora: an enabled LoRAConfig: the base frozen (bf16 under autocast), only adapters get gradients
            and AdamW state; None or disabled: full fine-tuning with fp32 weights.
        activation_checkpointing: False, True or "offload" (as TrainConfig.activation_checkpointing).
        bf16_autocast: activations in bf16.
    Returns:
        A dict of byte counts: weights, gradients, optimizer, per-token activations (device and host), and
        the estimated device peak.
    """
    adapted = lora is not None and lora.enabled
    params = parameter_count(config)
    activation_bytes = BF16 if bf16_autocast else FP32
    if adapted:
        base_bytes = BF16 if bf16_autocast and lora.base_dtype != "fp32" else FP32
        trainable = adapter_count(config, lora)
        weights = params * base_bytes + trainable * FP32
    else:
        base_bytes = FP32
        trainable = params
        weights = params * FP32
    residual_bytes = base_bytes  # the residual stream has the embedding's dtype
    block = block_activation_bytes_per_token(config, residual_bytes, activation_bytes, lora)
    block_input = config.d_model * residual_bytes
    head = config.d_model * (residual_bytes + FP32)  # the final hidden states and their fp32 gradient
    if activation_checkpointing:
        saved_inputs = config.n_layer * block_input
        device_per_token = (0 if activation_checkpointing == "offload" else saved_inputs) + 2 * block + head
        host_per_token = saved_inputs if activation_checkpointing == "offload" else 0
    else:
        device_per_token, host_per_token = config.n_layer * block + block + head, 0
    logits_chunk = CHUNK_LOGITS_ELEMENTS * (FP32 + activation_bytes)
    gradients, optimizer = trainable * FP32, trainable * FP32 * ADAMW_MOMENTS
    peak = weights + gradients + optimizer + tokens * device_per_token + logits_chunk
    return {"tokens": tokens, "parameters": params, "trainable_parameters": trainable, "weights": weights,
            "gradients": gradients, "optimizer": optimizer, "block_input_per_token": block_input,
            "block_activations_per_token": block, "device_activations_per_token": device_per_token,
            "host_activations_per_token": host_per_token, "host_activations": tokens * host_per_token,
            "estimated_peak": peak}


def format_plan(plan: dict) -> str:
    """The plan as a few lines, in GB and KB per token."""
    gb = 1e9
    return "\n".join([
        f"parameters {plan['parameters'] / 1e9:.2f}B, trainable {plan['trainable_parameters'] / 1e6:.1f}M",
        f"weights {plan['weights'] / gb:.2f} GB | gradients {plan['gradients'] / gb:.2f} GB | "
        f"AdamW {plan['optimizer'] / gb:.2f} GB",
        f"activations per token: {plan['device_activations_per_token'] / 1e3:.1f} KB on the device, "
        f"{plan['host_activations_per_token'] / 1e3:.1f} KB on the host (one block: "
        f"{plan['block_activations_per_token'] / 1e3:.1f} KB, its input {plan['block_input_per_token'] / 1e3:.1f} KB)",
        f"at {plan['tokens']:,} tokens: estimated device peak {plan['estimated_peak'] / gb:.1f} GB, "
        f"host {plan['host_activations'] / gb:.1f} GB",
    ])
