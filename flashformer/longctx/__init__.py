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
