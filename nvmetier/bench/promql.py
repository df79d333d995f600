"""The PromQL of nvmetier's Grafana dashboard (``docs/grafana/nvmetier.json``):
the metric names an expression reads, and its value over scraped samples.

Owns the subset of PromQL the dashboard is written in, so the dashboard can
be checked against what a real ``vllm serve`` exports (tests/serve) and
rendered without a Prometheus or Grafana server (``tools/render_dashboard.py``):

- ``metric_names``: a small tokenizer (strings, label matchers and range
  durations skipped; functions, aggregations and keywords told apart from
  metric names), for any expression, whether or not ``evaluate`` supports it;
- ``evaluate``: instant vector selectors with ``=``, ``!=``, ``=~``, ``!~``
  matchers; ``rate`` and ``increase`` of range selectors; ``sum``, ``max``,
  ``min``, ``avg``, ``count`` with ``by``/``without``; ``+ - * /`` between
  vectors (one-to-one on the whole label set, as PromQL matches by default)
  and with numbers. Anything else raises ``PromQLError``, so the renderer
  never draws a panel it did not compute.

``rate`` is the slope between the first and last sample of the window, with
counter resets handled, and ``increase`` is that rate times the window; both
without Prometheus's extrapolation to the window's edges (a few percent on
the first and last window of a series). Lookback for instant selectors:
5 minutes, as Prometheus's default.

A tool: runs on the calling thread, blocks for no I/O, imports nothing of vLLM.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Samples of one scrape: sample name -> [(labels, value)] (bench.serve.parse_metrics).
Scrape = Mapping[str, Sequence[tuple[Mapping[str, str], float]]]
# A vector: frozen label set -> value.
Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]

LOOKBACK_S = 300.0
AGGREGATIONS = frozenset({"sum", "max", "min", "avg", "count"})
RANGE_FUNCTIONS = frozenset({"rate", "increase"})
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
)
# Counter and histogram sample suffixes of the Prometheus text exposition.
SAMPLE_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")


class PromQLError(ValueError):
    """An expression outside the supported subset, or malformed."""


_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<duration>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)
  | (?P<ident>[a-zA-Z_:$][a-zA-Z0-9_:$]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/(){},=<>])
    """,
    re.VERBOSE,
)


def tokenize(expr: str) -> list[tuple[str, str]]:
    """``expr`` as (kind, text) tokens, whitespace dropped.

    Raises:
        PromQLError: a character no token starts with.
    """
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected character {expr[pos]!r} at {pos} in {expr!r}")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    """The metric (sample) names ``expr`` reads.

    An identifier is a metric name unless it is inside ``{...}`` (label
    matchers), follows ``by``/``without``/``on``/``ignoring`` in parentheses
    (label lists), is a keyword, or is called (``rate(``, ``sum(``,
    ``label_values(``) or is an aggregation with its clause first (``sum by
    (tier) (...)``). Grafana variables (``$x``) are not names.
    """
    metric = label_values_metric(expr)
    if metric is not None:  # a Grafana variable query: its second argument is a label
        return {metric}
    tokens = tokenize(expr)
    names: set[str] = set()
    depth_braces = 0
    label_list = False
    for i, (kind, text) in enumerate(tokens):
        if kind == "op":
            if text == "{":
                depth_braces += 1
            elif text == "}":
                depth_braces -= 1
            elif text == ")" and label_list:
                label_list = False
            elif text == "(" and i > 0 and tokens[i - 1][1] in ("by", "without", "on", "ignoring"):
                label_list = True
            continue
        if kind != "ident" or depth_braces or label_list or text.startswith("$"):
            continue
        if text in KEYWORDS:
            continue
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if following == "(" or (text in AGGREGATIONS and following in ("by", "without")):
            continue  # a function or an aggregation
        names.add(text)
    return names


def label_values_metric(query: str) -> str | None:
    """The metric of a Grafana ``label_values(metric, label)`` query, or None."""
    m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*\w+\s*\)\s*", query)
    return m.group(1) if m else None


def family(sample_name: str) -> str:
    """The metric family of a sample name (``x_total`` -> ``x``), as the text
    exposition's ``# TYPE`` line names it."""
    for suffix in SAMPLE_SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


# --- parsing ------------------------------------------------------------------
@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)
    range_s: float | None = None


@dataclass(frozen=True)
class Call:
    func: str
    arg: Selector


@dataclass(frozen=True)
class Aggregate:
    op: str
    grouping: tuple[str, ...] | None  # None: no clause (one output series)
    without: bool
    arg: Any


@dataclass(frozen=True)
class Binary:
    op: str
    left: Any
    right: Any


@dataclass(frozen=True)
class Number:
    value: float


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"1m30s"`` -> 90.0."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise PromQLError(f"bad duration {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


class _Parser:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens = tokenize(expr)
        self.pos = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("eof", "")

    def take(self, text: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok[0] == "eof" or (text is not None and tok[1] != text):
            want = f"{text!r}" if text else "a token"
            raise PromQLError(f"expected {want}, found {tok[1]!r} in {self.expr!r}")
        self.pos += 1
        return tok

    def parse(self) -> Any:
        node = self.additive()
        if self.peek()[0] != "eof":
            raise PromQLError(f"unexpected {self.peek()[1]!r} in {self.expr!r}")
        return node

    def additive(self) -> Any:
        node = self.multiplicative()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            node = Binary(op, node, self.multiplicative())
        return node

    def multiplicative(self) -> Any:
        node = self.primary()
        while self.peek() in (("op", "*"), ("op", "/")):
            op = self.take()[1]
            node = Binary(op, node, self.primary())
        return node

    def primary(self) -> Any:
        kind, text = self.peek()
        if kind == "number":
            self.take()
            return Number(float(text))
        if (kind, text) == ("op", "("):
            self.take()
            node = self.additive()
            self.take(")")
            return node
        if kind != "ident":
            raise PromQLError(f"unexpected {text!r} in {self.expr!r}")
        if text in AGGREGATIONS:
            return self.aggregate()
        if text in RANGE_FUNCTIONS:
            self.take()
            self.take("(")
            sel = self.selector()
            self.take(")")
            if sel.range_s is None:
                raise PromQLError(f"{text}() needs a range selector in {self.expr!r}")
            return Call(text, sel)
        if self.pos + 1 < len(self.tokens) and self.tokens[self.pos + 1] == ("op", "("):
            raise PromQLError(f"function {text}() is not supported in {self.expr!r}")
        return self.selector()

    def grouping(self) -> tuple[tuple[str, ...], bool]:
        without = self.take()[1] == "without"
        self.take("(")
        labels: list[str] = []
        while self.peek() != ("op", ")"):
            labels.append(self.take()[1])
            if self.peek() == ("op", ","):
                self.take()
        self.take(")")
        return tuple(labels), without

    def aggregate(self) -> Aggregate:
        op = self.take()[1]
        grouping: tuple[str, ...] | None = None
        without = False
        if self.peek()[1] in ("by", "without"):
            grouping, without = self.grouping()
        self.take("(")
        arg = self.additive()
        self.take(")")
        if grouping is None and self.peek()[1] in ("by", "without"):
            grouping, without = self.grouping()
        return Aggregate(op, grouping, without, arg)

    def selector(self) -> Selector:
        kind, name = self.take()
        if kind != "ident" or name in KEYWORDS:
            raise PromQLError(f"expected a metric name, found {name!r} in {self.expr!r}")
        matchers: list[tuple[str, str, str]] = []
        if self.peek() == ("op", "{"):
            self.take()
            while self.peek() != ("op", "}"):
                label = self.take()[1]
                op = self.take()[1]
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad matcher operator {op!r} in {self.expr!r}")
                kind_v, value = self.take()
                if kind_v != "string":
                    raise PromQLError(f"matcher value {value!r} is not a string in {self.expr!r}")
                matchers.append((label, op, _unquote(value)))
                if self.peek() == ("op", ","):
                    self.take()
            self.take("}")
        range_s = None
        if self.peek()[0] == "duration":
            range_s = parse_duration(self.take()[1][1:-1].strip())
        return Selector(name, tuple(matchers), range_s)


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text[1:-1])


def parse(expr: str) -> Any:
    """The syntax tree of ``expr``.

    Raises:
        PromQLError: outside the supported subset (module docstring).
    """
    return _Parser(expr).parse()


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` replaced from ``variables``.

    Raises:
        PromQLError: a variable with no value.
    """

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise PromQLError(f"no value for Grafana variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


# --- evaluation ---------------------------------------------------------------
def _matches(labels: Mapping[str, str], matchers: Sequence[tuple[str, str, str]]) -> bool:
    for label, op, want in matchers:
        have = labels.get(label, "")
        if op == "=" and have != want:
            return False
        if op == "!=" and have == want:
            return False
        if op == "=~" and re.fullmatch(want, have) is None:
            return False
        if op == "!~" and re.fullmatch(want, have) is not None:
            return False
    return True


def _series(
    scrapes: Sequence[tuple[float, Scrape]], sel: Selector, t0: float, t1: float
) -> dict[Labels, list[tuple[float, float]]]:
    out: dict[Labels, list[tuple[float, float]]] = {}
    for ts, scrape in scrapes:
        if not t0 < ts <= t1:
            continue
        for labels, value in scrape.get(sel.name, ()):
            if _matches(labels, sel.matchers):
                out.setdefault(frozenset(labels.items()), []).append((ts, value))
    return out


def _rate(points: Sequence[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    total = 0.0
    for (_, a), (_, b) in itertools.pairwise(points):
        total += b - a if b >= a else b  # a counter reset starts again from 0
    return total / (points[-1][0] - points[0][0])


def evaluate(node: Any, scrapes: Sequence[tuple[float, Scrape]], t: float) -> Vector | float:
    """The value of ``node`` (``parse``) at time ``t`` over ``scrapes``
    ((timestamp, samples) in time order): a vector, or a number."""
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Selector):
        if node.range_s is not None:
            raise PromQLError(f"a range selector of {node.name} outside rate()/increase()")
        series = _series(scrapes, node, t - LOOKBACK_S, t)
        return {labels: pts[-1][1] for labels, pts in series.items()}
    if isinstance(node, Call):
        window = node.arg.range_s or 0.0
        out: Vector = {}
        for labels, pts in _series(scrapes, node.arg, t - window, t).items():
            r = _rate(pts)
            if r is not None:
                out[labels] = r * window if node.func == "increase" else r
        return out
    if isinstance(node, Aggregate):
        arg = evaluate(node.arg, scrapes, t)
        if not isinstance(arg, dict):
            raise PromQLError(f"{node.op}() of a number")
        groups: dict[Labels, list[float]] = {}
        for labels, value in arg.items():
            if node.grouping is None:
                key: Labels = frozenset()
            elif node.without:
                key = frozenset((k, v) for k, v in labels if k not in node.grouping)
            else:
                key = frozenset((k, v) for k, v in labels if k in node.grouping)
            groups.setdefault(key, []).append(value)
        return {key: _aggregate(node.op, values) for key, values in groups.items()}
    if isinstance(node, Binary):
        left = evaluate(node.left, scrapes, t)
        right = evaluate(node.right, scrapes, t)
        if not isinstance(left, dict) and not isinstance(right, dict):
            return _arith(node.op, left, right)
        if not isinstance(left, dict):
            assert isinstance(right, dict)
            return {k: _arith(node.op, left, v) for k, v in right.items()}
        if not isinstance(right, dict):
            return {k: _arith(node.op, v, right) for k, v in left.items()}
        # One-to-one matching on the whole label set (no on/ignoring).
        return {k: _arith(node.op, v, right[k]) for k, v in left.items() if k in right}
    raise PromQLError(f"cannot evaluate {node!r}")


def _aggregate(op: str, values: Sequence[float]) -> float:
    if op == "sum":
        return math.fsum(values)
    if op == "max":
        return max(values)
    if op == "min":
        return min(values)
    if op == "avg":
        return math.fsum(values) / len(values)
    return float(len(values))  # count


def _arith(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:  # as PromQL: x/0 is +-Inf, 0/0 is NaN
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
    return a / b


def legend(fmt: str, labels: Labels) -> str:
    """Grafana's ``legendFormat``: ``{{label}}`` replaced by the label's value."""
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt)


# --- the dashboard --------------------------------------------------------------
def dashboard_expressions(dashboard: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """Every PromQL expression of a Grafana dashboard: (panel title, refId,
    expression) for each panel target (rows' nested panels included), and
    (``$name``, ``query``, metric) for each ``label_values`` variable query."""
    out: list[tuple[str, str, str]] = []

    def walk(panels: Sequence[Mapping[str, Any]]) -> None:
        for p in panels:
            for target in p.get("targets", []):
                if "expr" in target:
                    out.append(
                        (str(p.get("title", "")), str(target.get("refId", "")), target["expr"])
                    )
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, Mapping):
            query = query.get("query")
        if var.get("type") == "query" and isinstance(query, str):
            metric = label_values_metric(query)
            out.append((f"${var.get('name')}", "query", metric if metric else query))
    return out
