"""Tokens-to-target factors measured by the recipe study (written by ``python -m benchmarks.report``)."""

STUDY = "the recipe study of docs/benchmarks.md: the examples' Llama (1.38 M parameters) on Shakespeare, 4 groups of one rank, 2,048 tokens a step, sync every 8, 1,200 steps (150 outer rounds), 2 seed(s) paired"  # noqa: E501
#: {option key: (median factor, recipe, per-seed factors, measured at the recipe's own final loss)}
FACTORS: dict[tuple[object, ...], tuple[float, str, tuple[float, ...], bool]] = {
    (8, 1, "float32", 0, None, "fedavg"): (1.0, "fedavg_f32", (1.0, 1.0), False),
    ("fsdp",): (0.479, "fsdp", (0.4735, 0.4845), False),
    (32, 1, "float32", 0, None, "fedavg"): (1.5345, "h32_fedavg_f32", (1.4909, 1.5781), True),
    (8, 1, "int4", 0, None, "fedavg"): (1.0282, "int4ef", (0.937, 1.1194), True),
    (8, 1, "int4", 0, None, "nesterov"): (4.1278, "int4ef_nesterov", (4.2326, 4.023), True),
    (8, 1, "float32", 0, None, "nesterov"): (3.7064, "nesterov_f32", (4.097, 3.3157), True),
    (8, 1, "float32", 1, None, "nesterov"): (5.5634, "overlap1_f32", (4.8619, 6.2649), True),
    (8, 1, "sparse", 0, None, "fedavg"): (2.2226, "sparse", (2.1604, 2.2848), True),
}
