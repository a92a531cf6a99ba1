"""Print a Markdown table (mean ± std over repeats) from an offline_sweep.py JSON."""
import json
import statistics
import sys


def main(path: str) -> None:
    doc = json.load(open(path))
    rows = doc["rows"]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})

    def cell(arm, c, key, fmt="{:.0f}"):
        xs = [r[key] for r in rows if r["arm"] == arm and r["concurrency"] == c and r.get(key) is not None]
        if not xs:
            return "–"
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return (fmt + " ± " + fmt).format(statistics.mean(xs), sd)

    for key, title, fmt in (("output_throughput", "output tok/s", "{:.0f}"),
                            ("median_user_speed", "per-user tok/s (median over requests)", "{:.1f}"),
                            ("mean_accepted_length", "mean accepted length (bonus included)", "{:.2f}")):
        print(f"\n{title}\n")
        print("| C | " + " | ".join(arms) + " |")
        print("|---" * (len(arms) + 1) + "|")
        for c in concs:
            print(f"| {c} | " + " | ".join(cell(a, c, key, fmt) for a in arms) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
