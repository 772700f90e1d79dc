"""kvtier benchmarks (installed as kvtier_bench; run them with `kvtier bench NAME`)."""
