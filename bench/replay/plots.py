"""PNG plots of replay results (``results.json`` written by ``pdserve bench``).

- :func:`plot_comparison`: SLO attainment vs request rate, one line per configuration with
  the target line and each goodput marked, next to the TTFT and TPOT CDFs of every
  configuration at one rate;
- :func:`plot_rates`: one configuration's TTFT and TPOT CDFs, one line per rate.

CDFs count every request of a replay: failed or unfinished ones never arrive, so a curve
that stops below 1 shows them. Combine several configurations into one figure::

    python -m pdserve.bench.replay.plots OUT_DIR1 OUT_DIR2 ... --out compare.png [--rate 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"))


def load_results(path: str | Path) -> dict:
    """``results.json`` of an output directory (or the file itself)."""
    path = Path(path)
    return json.loads((path / "results.json" if path.is_dir() else path).read_text())


def plot_comparison(results: list[dict], out: str | Path, rate: float | None = None) -> Path:
    """Attainment vs rate plus TTFT/TPOT CDFs at ``rate`` (default: the highest rate every
    configuration ran, else each one's highest) for one or more configurations."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _attainment_axes(axes[0], results)
    common = set.intersection(*({run["rate"] for run in res["runs"]} for res in results)) if results else set()
    at = rate if rate is not None else (max(common) if common else None)
    for res in results:
        run = _run_at(res, at)
        if run is None:
            continue
        name = f"{res['label']} @ {run['rate']:.3g} req/s"
        for ax, (key, title) in zip(axes[1:], METRICS):
            _cdf(ax, run["records"], key, name)
    for ax, (key, title) in zip(axes[1:], METRICS):
        _cdf_style(ax, title, [res["slo"][key] for res in results])
    fig.tight_layout()
    return _save(fig, out)


def plot_rates(result: dict, out: str | Path) -> Path:
    """TTFT and TPOT CDFs of one configuration, one line per rate."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for run in result["runs"]:
        for ax, (key, _) in zip(axes, METRICS):
            _cdf(ax, run["records"], key, f"{run['rate']:.3g} req/s")
    for ax, (key, title) in zip(axes, METRICS):
        _cdf_style(ax, title, [result["slo"][key]], f" ({result['label']})")
    fig.tight_layout()
    return _save(fig, out)


def _attainment_axes(ax, results: list[dict]) -> None:
    target = results[0]["target"] if results else 0.9
    for res in results:
        rates = [run["rate"] for run in res["runs"]]
        line, = ax.plot(rates, [run["attainment"]["both"] for run in res["runs"]], "o-", label=res["label"])
        if len(results) == 1:
            ax.plot(rates, [run["attainment"]["ttft"] for run in res["runs"]], "--", color=line.get_color(),
                    alpha=0.6, label="TTFT SLO only")
            ax.plot(rates, [run["attainment"]["tpot"] for run in res["runs"]], ":", color=line.get_color(),
                    alpha=0.6, label="TPOT SLO only")
        g = res.get("goodput")
        if g and g["kind"] != "below_lowest":
            ax.plot([g["rate"]], [target], "*", ms=14, color=line.get_color())
            ax.annotate(f"{g['rate']:.3g}{'+' if g['kind'] == 'lower_bound' else ''}", (g["rate"], target),
                        textcoords="offset points", xytext=(4, 6), color=line.get_color())
    ax.axhline(target, color="gray", lw=1, ls="--")
    ax.set(xlabel="request rate (requests/s)", ylabel="SLO attainment (TTFT and TPOT)", ylim=(-0.02, 1.05),
           title="SLO attainment vs rate (star: goodput)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _cdf(ax, records: list[dict], key: str, label: str) -> None:
    values = sorted(r[key] * 1e3 for r in records if r["status"] == "OK" and r.get(key) is not None)
    if values:
        n = len(records)
        ax.step(values, [(i + 1) / n for i in range(len(values))], where="post", label=label)


def _cdf_style(ax, metric: str, slos: list[float], suffix: str = "") -> None:
    for slo in sorted(set(slos)):
        ax.axvline(slo * 1e3, color="gray", lw=1, ls="--")
    ax.set(xlabel=f"{metric} (ms, at the client; dashed: SLO)", ylabel="fraction of requests", ylim=(0, 1.02),
           title=f"{metric} CDF{suffix}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(_minor_label))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _minor_label(v: float, _pos) -> str:
    """Label the 2x and 5x ticks of a log axis."""
    return f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""


def _run_at(res: dict, rate: float | None) -> dict | None:
    runs = res["runs"]
    if not runs:
        return None
    if rate is None:
        return max(runs, key=lambda run: run["rate"])
    return min(runs, key=lambda run: abs(run["rate"] - rate))


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.replay.plots", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="output directories (or results.json files) of pdserve bench")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--rate", type=float, default=None, help="rate (requests/s) of the CDF panels")
    args = ap.parse_args(argv)
    results = [load_results(p) for p in args.results]
    if len({(r["slo"]["ttft_s"], r["slo"]["tpot_s"], r["target"]) for r in results}) > 1:
        print("warning: the results use different SLOs or targets; their attainment is not comparable",
              file=sys.stderr)
    labels = [r["label"] for r in results]
    for i, r in enumerate(results):
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']} ({Path(args.results[i]).name})"
    print(plot_comparison(results, args.out, args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
