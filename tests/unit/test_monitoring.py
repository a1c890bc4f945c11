"""deploy/: the Grafana dashboard asks only for metrics the service exports, and a real Prometheus
(Debian's ``prometheus``, installed by ``deploy/local.sh``) scrapes the service with the scrape config from deploy/.

Without a ``prometheus`` binary the Prometheus test skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import re

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


IDENTIFIER = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, aggregations, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = LABEL_LISTS.sub("", expr)  # by (...), on (...), ...
    names = set()
    for match in IDENTIFIER.finditer(expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group() in KEYWORDS:
            continue  # a function or aggregation call
        names.add(match.group())
    return names


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.95, sum by (le, tool) (rate(ptc_tool_call_duration_seconds_bucket{tool!="x"}[5m])))'
    ) == {"ptc_tool_call_duration_seconds_bucket"}
    assert promql_metric_names(
        'sum(rate(a_total{s!="ok"}[$__rate_interval])) / on (job) group_left sum without (i) (b) > bool 1e3'
    ) == {"a_total", "b"}
    assert promql_metric_names('label_replace(up, "x", "$1", "job", "(.*)")') == {"up"}
