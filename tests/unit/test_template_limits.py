"""Template operations that could explode are refused before they run, naming the
limit: integer growth, string and sequence building (operators, ``~``, displays,
formatting, filters, methods, globals), loop iterations and what a render builds in
total. Small limits keep every case cheap; memory is measured, wall-clock is not."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from noetl_common.config import LimitSettings
from noetl_dsl import templates
from noetl_dsl.templates import TemplateError, render, render_str, render_text

SMALL = LimitSettings.model_construct(template_value_size=100_000, template_int_bits=4096,
                                      template_iterations=10_000, template_render_size=1_000_000)


@pytest.fixture(autouse=True)
def small_limits() -> Iterator[None]:
    templates.configure(SMALL)
    yield
    templates.configure()


def refused(source: str, ctx: dict[str, Any] | None = None, *, text: bool = False) -> TemplateError:
    """The TemplateError ``source`` renders to; the refusal allocated little."""
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError) as info:
            (render_text if text else render_str)(source, ctx or {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"{source!r} allocated {peak} bytes before being refused"
    return info.value


def setting(source: str, ctx: dict[str, Any] | None = None, *, text: bool = False) -> str:
    err = refused(source, ctx, text=text)
    assert err.limit is not None, err.message
    assert err.message.endswith(f"limit {err.limit.env}={err.limit.limit}")
    return err.limit.setting


BIG = "x" * 60_000  # more than half the value limit: any two of it are too many


@pytest.mark.parametrize("source", [
    "{{ 3 ** (3 ** 16) }}",
    "{{ 7 ** 5000 }}",
    "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}",
    "{{ (2 ** 3000) * (2 ** 3000) }}",
])
def test_integer_growth(source: str) -> None:
    assert setting(source) == "template_int_bits"


def test_three_to_the_three_to_the_sixteen_fails_fast_with_the_default_limits() -> None:
    templates.configure()
    err = refused("{{ 3**(3**16) }}")
    assert err.message == "`**` result is 68227440 bits; limit NOETL_LIMIT_TEMPLATE_INT_BITS=65536"


@pytest.mark.parametrize("source", [
    "{{ 'ab' * 1000000 }}",
    "{{ [[1, 2]] * 60000 }}",                       # few items, printed large
    "{{ big ~ big }}",
    "{{ big + big }}",
    "{{ [big, big] }}",
    "{{ {'a': big, 'b': big} }}",
    "{{ (big, big) }}",
    "{{ '%0*d' % (1000000, 1) }}",
    "{{ '%999999d' % 1 }}",
    "{{ '%(a)s%(a)s' % {'a': big} }}",
    "{{ '%s%s' | format(big, big) }}",
    "{{ '{0}{0}'.format(big) }}",
    "{{ '{:>{w}}'.format('a', w=1000000) }}",
    "{{ '{x}{x}'.format_map({'x': big}) }}",
    "{{ 'x'.center(1000000) }}",
    "{{ 'x'.ljust(1000000) }}",
    "{{ 'x'.rjust(1000000, '-') }}",
    "{{ '1'.zfill(1000000) }}",
    "{{ '\t\t'.expandtabs(1000000) }}",
    "{{ 'aaaa'.replace('a', big) }}",
    "{{ 'ab'.translate({97: big}) }}",
    "{{ big.join(['a', 'b', 'c']) }}",
    "{{ (1).to_bytes(1000000, 'big') }}",
    "{{ {}.fromkeys(range(9000), big[:20]) }}",
    "{{ dict(a=big, b=big) }}",
    "{{ namespace(a=big, b=big) }}",
    "{{ 'x' | center(1000000) }}",
    "{{ 'a\nb' | indent(1000000) }}",
    "{{ big[:1000] | wordwrap(1, wrapstring='y' * 1000) }}",
    "{{ range(100) | join('x' * 2000) }}",
    "{{ 'aaa' | replace('a', big) }}",
    "{{ [1] | batch(1000000, 'fill') | list }}",
    "{{ ('a ' * 100) | urlize(target='t' * 5000) }}",
    "{{ lipsum(1000000) }}",
    "{% set a = [1] * 10 %}{% set b = [a] * 10 %}{% set c = [b] * 10 %}{% set d = [c] * 10 %}"
    "{% set e = [d] * 10 %}{{ e }}",                # a shared structure, 10^5 leaves once printed
])
def test_values_beyond_the_size_limit(source: str) -> None:
    assert setting(source, {"big": BIG}) == "template_value_size"


@pytest.mark.parametrize("filter_name", ["tojson", "to_json", "pprint", "string", "upper", "urlencode",
                                         "xmlattr", "escape", "title", "trim"])
def test_filters_measure_what_they_print(filter_name: str) -> None:
    # A value from the render scope printed by a filter: two references to one string
    # print as twice its size.
    ctx = {"v": {"a": BIG, "b": BIG}}
    assert setting(f"{{{{ v | {filter_name} }}}}", ctx) == "template_value_size"


def test_fromjson_refuses_deep_text_before_decoding() -> None:
    err = refused("{{ s | fromjson }}", {"s": "[" * 5000 + "]" * 5000})
    assert err.limit is not None and err.limit.setting == "nesting_depth"


@pytest.mark.parametrize("source", [
    "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
    "{% for x in 'x' * 90000 %}{% endfor %}",
    "{% for x in [1, 2] recursive %}{% if loop.depth < 30 %}{{ loop([1, 2]) }}{% endif %}{% endfor %}",
    "{{ range(1000000) | list }}",
    "{{ [1, 2] | slice(1000000) | list }}",
    "{% macro m() %}{% for i in range(9000) %}{% endfor %}{% endmacro %}{{ m() }}{{ m() }}",
])
def test_loop_iterations(source: str) -> None:
    assert setting(source) == "template_iterations"


@pytest.mark.parametrize("source", [
    # each value is within the limit; what the render builds in total is not
    "{% set s = 'x' * 90000 %}{% for i in range(100) %}{% set t = s ~ '' %}{% endfor %}",
    "{% set x %}{% for i in range(5000) %}{{ 'y' * 400 }}{% endfor %}{% endset %}{{ x | length }}",
    "{% set x %}{% for i in range(9000) %}" + "z" * 200 + "{% endfor %}{% endset %}{{ x | length }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(5000) %}{% set ns.l = ns.l + [i] %}{% endfor %}",
])
def test_what_one_render_builds_in_total(source: str) -> None:
    assert setting(source) == "template_render_size"


def test_text_output_is_bounded_as_it_is_generated() -> None:
    err = refused("{% for i in range(300) %}{{ 'x' * 1000 }}{% endfor %}", text=True)
    assert err.limit is not None and err.limit.setting == "template_value_size"
    assert "template output is at least" in err.message


def test_refusals_inside_every_construct() -> None:
    # set, for, filters, method calls, formatting: the same check wherever it sits
    for source in ["{% set x = 'ab' * 1000000 %}",
                   "{% for i in range(3) %}{{ 'ab' * 1000000 }}{% endfor %}",
                   "{{ ('ab' * 1000000) | length }}",
                   "{{ 'ab'.upper() * 1000000 }}",
                   "{{ ('%s' % 'ab') * 1000000 }}",
                   "{% if true %}{{ 'ab' * 1000000 }}{% endif %}",
                   "{% macro m(n) %}{{ 'ab' * n }}{% endmacro %}{{ m(1000000) }}",
                   "{% filter upper %}{{ 'ab' * 1000000 }}{% endfilter %}"]:
        assert setting(source) == "template_value_size", source


def test_hostile_syntax_is_a_template_error() -> None:
    for source in ["{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "{{ " + "9" * 6000 + " }}"]:
        with pytest.raises(TemplateError, match="syntax error"):
            render_str(source, {})


@pytest.mark.parametrize(("source", "expected"), [
    ("{{ 2 ** 64 }}", 2 ** 64),
    ("{{ 10 ** 1000 > 1 }}", True),
    ("{{ 'ab' * 3 }}", "ababab"),
    ("{{ [0] * 3 }}", [0, 0, 0]),
    ("{{ 3 * 'x' }}", "xxx"),
    ("{{ [1] + [2] }}", [1, 2]),
    ("{{ 'a' ~ 1 ~ none }}", "a1None"),
    ("{{ '%05.1f|%-3s|%(x)s' % (1.25, 'a', {}) if false else '%05.1f|%-3s' % (1.25, 'a') }}", "001.2|a  "),
    ("{{ '{:>4}|{:.2f}|{x}'.format('a', 2, x=[1]) }}", "   a|2.00|[1]"),
    ("{{ 'a-b'.replace('-', '--') }}", "a--b"),
    ("{{ ','.join(['a', 'b']) }}", "a,b"),
    ("{{ 'x'.center(5, '*') }}", "**x**"),
    ("{{ 'ab' | center(6) }}", "  ab  "),
    ("{{ 'a\nb' | indent(2, true) }}", "  a\n  b"),
    ("{{ [1, 2, 3] | join('-') }}", "1-2-3"),
    ("{{ [1, 2, 3] | batch(2, 0) | list }}", [[1, 2], [3, 0]]),
    ("{{ [1, 2, 3] | slice(2) | list }}", [[1, 2], [3]]),
    ("{{ [[1], [2, 3]] | sum(start=[]) }}", [1, 2, 3]),
    ("{{ [(1,), (2,)] | sum(start=()) }}", (1, 2)),
    ("{{ [1, 2] | sum }}", 3),
    ("{{ [{'n': 2}, {'n': 3}] | sum(attribute='n') }}", 5),
    ("{{ '%s=%s' | format('a', 1) }}", "a=1"),
    ("{{ {'a': [1, {'b': 2}]} | tojson }}", '{"a": [1, {"b": 2}]}'),
    ("{{ '[1, 2]' | fromjson }}", [1, 2]),
    ("{{ range(3) | list }}", [0, 1, 2]),
    ("{{ dict(a=1) }}", {"a": 1}),
    ("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", "10"),
    ("{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{{ loop.length }}{% endfor %}", "a=11"),
    ("{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}"
     "{% endfor %}", "123"),
    ("{{ (1).to_bytes(2, 'big') }}", b"\x00\x01"),
    ("{{ 'ab'.translate({97: 'zz'}) }}", "zzb"),
])
def test_ordinary_templates_render_as_before(source: str, expected: Any) -> None:
    assert render_str(source, {}) == expected


def test_limits_are_per_render_and_configured_once() -> None:
    loop = "{% for i in range(6000) %}{% endfor %}"
    render_str(loop, {})
    render_str(loop, {})  # a fresh budget for each render
    templates.configure(LimitSettings.model_construct(template_iterations=5000))
    with pytest.raises(TemplateError, match="NOETL_LIMIT_TEMPLATE_ITERATIONS=5000"):
        render_str(loop, {})
    templates.configure()
    assert render(["{{ 'a' * 3 }}", {"k": "{{ 2 ** 10 }}"}], {}) == ["aaa", {"k": 1024}]


def test_validation_parses_without_compiling_unless_compiling_can_fail() -> None:
    templates.check_syntax("{{ workload.x + 1 }}")
    with pytest.raises(TemplateError, match="No filter named 'nope'"):
        templates.check_syntax("{{ x | nope }}")
    with pytest.raises(TemplateError, match="syntax error"):
        templates.check_syntax("{{ x + }}")
