"""A/B: zero++ with eager vs compiled quantization, unshaped and 1 Gbit/s (batch 8), beside ZeRO-3."""
import json, statistics, sys
from zeropp_tools.bench.cells import measure
from zeropp_tools.cluster import ClusterSpec
if __name__ == "__main__":
    results = {}
    for rep in range(2):
        for bandwidth, batch in ((None, 4), (1000.0, 8)):
            for name, extra in (("zero3", []), ("zero++", []), ("zero++ compiled", ["--compile-quantization"])):
                variant = "zero3" if name == "zero3" else "zero++"
                args = ["--model", "medium", "--steps", "20", "--batch-per-rank", str(batch), "--seq-len", "64",
                        "--precision", "bf16", *extra]
                r = measure(ClusterSpec(2, 2, bandwidth), variant, args)
                key = f"{bandwidth or 'unshaped'} b{batch} {name}"
                results.setdefault(key, []).append(r["tokens_per_s"])
                print(key, round(r["tokens_per_s"]), flush=True)
    json.dump(results, open("/tmp/bench/compile_ab.json", "w"), indent=1)
    for key, values in results.items():
        print(key, round(statistics.median(values)), values)
