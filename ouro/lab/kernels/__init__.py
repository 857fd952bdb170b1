"""`ouro probe kernels`: per-op microbenchmarks over the model's shapes, correct against the naive
reference first, then timed against the roofline and weighed by their share of a real step."""
