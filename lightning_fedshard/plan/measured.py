"""Tokens-to-target factors measured by the recipe study (written by ``python -m benchmarks.report``)."""

STUDY = "the recipe study of docs/benchmarks/recipes.md: the examples' Llama (1.38 M parameters) on Shakespeare, 4 groups of one rank, 2,048 tokens a step, sync every 8, 1,200 steps (150 outer rounds), 2 seed(s) paired; the target: FSDP's final loss after as many tokens (one group of 4 ranks, the same 2,048 tokens a step), which some federations reach only in runs of 3x the tokens"  # noqa: E501
#: {option key: (median factor, recipe, per-seed factors, measured at the recipe's own final loss)}
FACTORS: dict[tuple[object, ...], tuple[float, str, tuple[float, ...], bool]] = {
    (8, 1, "float32", 0, "share", "fedavg"): (4.4232, "eager_fedavg_f32", (5.7212, 3.1253), True),
    (8, 1, "float32", 0, None, "fedavg"): (2.1725, "fedavg_f32_x3", (2.2155, 2.1295), False),
    ("fsdp",): (1.0, "fsdp", (1.0, 1.0), False),
    (32, 1, "float32", 0, None, "fedavg"): (2.7091, "h32_fedavg_f32", (2.784, 2.6342), True),
    (8, 1, "int4", 0, None, "nesterov"): (6.1098, "int4ef_nesterov", (6.3153, 5.9042), True),
    (8, 1, "int4", 0, None, "fedavg"): (2.288, "int4ef_x3", (2.414, 2.162), False),
    (8, 1, "float32", 0, None, "nesterov"): (5.6227, "nesterov_f32", (6.2044, 5.0411), True),
    (8, 1, "float32", 1, None, "nesterov"): (7.5584, "overlap1_f32", (6.8067, 8.31), True),
    (8, 1, "sparse", 0, None, "fedavg"): (3.5019, "sparse", (3.5395, 3.4644), True),
}
