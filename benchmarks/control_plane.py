"""CPU per request lifecycle, P and D together, with N requests in flight (a benchmark, not a test).

Two measurements, each in waves of N requests admitted at once and run to `done` (see
kvfsm/bench/_control.py): the sans-I/O core alone, and two engines on `SimFabric`. Prints a table
(and `--json`); figures are CPU microseconds per lifecycle, best of `--repeat`, and the bytes the
two cores hold per request while N wait mid-transfer (matched, posted, not completed).
"""

from __future__ import annotations

import argparse
import json

from kvfsm.bench import control_bench, memory_per_request


def main() -> None:
    """Run the benchmark and print a table, or JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--total", type=int, default=20000, help="lifecycles per measurement")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--conformance", action="store_true", help="also the core with the run-time check on"
    )
    args = parser.parse_args()
    results: dict[str, dict[int, dict[str, float]]] = {}
    for mode in ("push", "pull"):
        results[mode] = {
            n: control_bench(mode, n, max(args.total, n), args.repeat, conformance=args.conformance)
            for n in args.in_flight
        }
        for n, figures in results[mode].items():
            figures["bytes_per_request"] = round(memory_per_request(mode, n))
    if args.json:
        print(json.dumps(results))
        return
    print(
        f"{'mode':<6}{'in flight':>10}{'core us':>10}{'engine us':>11}{'bytes/req':>11}"
        f"{'core + conformance us':>23}"
    )
    for mode, by_n in results.items():
        for n, f in by_n.items():
            print(
                f"{mode:<6}{n:>10}{f['core_us']:>10}{f['engine_us']:>11}{f['bytes_per_request']:>11}"
                f"{f.get('core_conformance_us', '-'):>23}"
            )
    for mode, by_n in results.items():
        for key in ("core_us", "engine_us"):
            values = [f[key] for f in by_n.values()]
            print(f"{mode} {key}: max/min across in-flight = {max(values) / min(values):.2f}")


if __name__ == "__main__":
    main()
