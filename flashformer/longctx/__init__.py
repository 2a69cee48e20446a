"""Context extension: rescale RoPE, fine-tune on packed long documents, measure what it bought.

    flashformer finetune-long runs/tiny --target-len 1024 --scaling linear --steps 200

extend.py    RoPE scalings (linear, yarn, llama3, ntk) and the long-context fine-tuning recipe
passkey.py   passkey retrieval prompts, accuracy, and passkey examples for the training data
evaluate.py  perplexity against evaluated length; one model's evaluation at every length
report.py    position interpolation's claim (PASS / FAIL), the markdown table, the plot
run.py       the command: extend, evaluate, fine-tune through flashformer.train, evaluate, report
"""

from .evaluate import evaluate_long_context, held_out_windows, perplexity
from .extend import (
    EXTENDED_INIT_DIR,
    SCALINGS,
    extended_model_config,
    long_context_train_config,
    resolve_checkpoint,
    save_extended_checkpoint,
)
from .passkey import (
    DEFAULT_PASSKEY_DEPTHS,
    PASSKEY_TRAIN_DIR,
    PasskeyPrompt,
    build_passkey_prompt,
    mix_in_passkey_documents,
    passkey_accuracy,
    passkey_min_length,
    passkey_prompts,
    write_passkey_documents,
)
from .report import (
    CLAIM_DEGRADATION,
    MARKDOWN_FILE,
    MODELS,
    PLOT_FILE,
    REPORT_FILE,
    extension_claim,
    markdown_report,
    plot_perplexity,
)
from .run import finetune_long

__all__ = [
    "CLAIM_DEGRADATION", "DEFAULT_PASSKEY_DEPTHS", "EXTENDED_INIT_DIR", "MARKDOWN_FILE", "MODELS", "PASSKEY_TRAIN_DIR",
    "PLOT_FILE", "REPORT_FILE", "SCALINGS", "PasskeyPrompt", "build_passkey_prompt", "evaluate_long_context",
    "extended_model_config", "extension_claim", "finetune_long", "held_out_windows", "long_context_train_config",
    "markdown_report", "mix_in_passkey_documents", "passkey_accuracy", "passkey_min_length", "passkey_prompts",
    "perplexity", "plot_perplexity", "resolve_checkpoint", "save_extended_checkpoint", "write_passkey_documents",
]
