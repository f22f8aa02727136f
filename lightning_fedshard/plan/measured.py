"""Tokens-to-target factors measured by the recipe study (written by ``python -m benchmarks.report``)."""

STUDY = "the recipe study of docs/benchmarks.md: the examples' Llama (1.38 M parameters) on Shakespeare, 4 groups of one rank, 2,048 tokens a step, sync every 8, 1,200 steps (150 outer rounds), 2 seed(s) paired"  # noqa: E501
FACTORS: dict[tuple[object, ...], tuple[float, str, tuple[float, ...]]] = {
    (8, 1, "float32", 0, None, "fedavg"): (1.0, "fedavg_f32", (1.0, 1.0)),
    ("fsdp",): (0.4790305995761763, "fsdp", (0.47351220725088466, 0.4845489919014679)),
}
