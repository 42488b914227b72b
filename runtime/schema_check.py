"""What a JSON schema may hold for structured output: every keyword is enforced by xgrammar's grammar
or refused, and a schema is small enough to compile in bounded time (runtime/constraint.py calls
`schema_refusal` before it converts a schema, and `pattern_refusal` for a regular expression).

xgrammar (0.2.9) converts a schema to a grammar, and drops, with at most a warning on its log, what it
cannot express; the output then breaks the schema. Which keywords it enforces was found by reading its
converter (cpp/json_schema_converter.cc) and checked one keyword at a time: each schema compiled with a
byte tokenizer, a value the keyword forbids fed to the matcher, rejected (enforced) or accepted
(refused here); tests/test_schema_keywords.py keeps both lists. The walk follows what xgrammar reads:
the subschemas of properties, patternProperties, additionalProperties, unevaluatedProperties,
propertyNames, items, prefixItems, unevaluatedItems, anyOf, oneOf, a one-member allOf, and local $refs
(each target once); the first refusal found is the answer, naming the keyword and its JSON pointer.

Limits, measured on this repository's machine (Intel Xeon, 2 cores; docs/serving.md has the figures):
the schema's JSON text, its number of subschemas, the optional (not required) properties of one object
(xgrammar's compile time grows with their count to about the 2.7th power), and the repetitions of its
patterns (converting `x{1,n}` takes time quadratic in n).
"""

from __future__ import annotations

import json
import math
import re

MAX_SCHEMA_BYTES = 128 * 1024  # the schema's JSON text
MAX_SUBSCHEMAS = 5000  # subschemas walked (each property's, each item's, each member's, ...)
MAX_DEPTH = 64  # subschemas nested in one another
MAX_OPTIONAL_PROPERTIES = 256  # properties of one object that are not required
MAX_OPTIONAL_TOTAL = 1024  # and of all objects together
MAX_PATTERN_COST = 2_000_000  # sum over patterns of each repetition's bound squared times what it repeats

# keywords with no say over which values are valid: fine anywhere
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "examples",
        "example",
        "default",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$anchor",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "discriminator",
    }
)
CONTAINERS = frozenset({"$defs", "definitions"})  # read only through a $ref into them

# refused wherever they stand: xgrammar does not enforce them
NOT_ENFORCED = {
    "not": "xgrammar cannot exclude a subschema",
    "if": "xgrammar ignores if/then/else",
    "then": "xgrammar ignores if/then/else",
    "else": "xgrammar ignores if/then/else",
    "dependentRequired": "xgrammar ignores it",
    "dependentSchemas": "xgrammar ignores it",
    "dependencies": "xgrammar ignores it",
    "contains": "xgrammar ignores it (an array without the item is written)",
    "minContains": "xgrammar ignores contains",
    "maxContains": "xgrammar ignores contains",
    "uniqueItems": "xgrammar ignores it (repeated items are written)",
    "additionalItems": "xgrammar does not read it (use prefixItems with items)",
    "$dynamicRef": "xgrammar resolves only local $refs",
    "$dynamicAnchor": "xgrammar resolves only local $refs",
    "$recursiveRef": "xgrammar resolves only local $refs",
    "$recursiveAnchor": "xgrammar resolves only local $refs",
    "$vocabulary": "xgrammar does not read vocabularies",
}

# what xgrammar reads for each type (keywords of other types do not apply to a value of this one)
TYPE_KEYWORDS = {
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"},
    "object": {
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
    },
    "boolean": set(),
    "null": set(),
}
BRANCHES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # each replaces the rest of its schema
KNOWN = ANNOTATIONS | CONTAINERS | set(BRANCHES) | {"type", "$id"} | set().union(*TYPE_KEYWORDS.values())

# formats xgrammar writes a regular expression for (any other is ignored)
FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
INTEGER_MULTIPLE_MAX = 1024  # xgrammar's cap on an integer multipleOf
INTEGER_MULTIPLE_RANGE = 10000  # and on the integers a bounded one may range over


class Refused(Exception):
    """One refusal's sentence."""


def schema_refusal(schema) -> str | None:
    """Why `schema` cannot be enforced as it stands (one sentence naming the keyword and where), or None."""
    try:
        size = len(json.dumps(schema, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return "the schema is not JSON"
    if size > MAX_SCHEMA_BYTES:
        return f"the schema is {size} bytes of JSON, over the limit of {MAX_SCHEMA_BYTES}"
    try:
        _Walk(schema).schema(schema, "#", 0)
    except Refused as e:
        return str(e)
    return None


def pattern_refusal(pattern: str, where: str = "the pattern") -> str | None:
    """Why a regular expression cannot be enforced (xgrammar ignores lookarounds and anchors inside it;
    long repetitions take too long to convert), or None."""
    try:
        cost = _pattern_cost(pattern, where)
    except Refused as e:
        return str(e)
    if cost > MAX_PATTERN_COST:
        return f"{where}: its repetitions cost {cost}, over the limit of {MAX_PATTERN_COST} (see docs/serving.md)"
    return None


def _pointer(path: str, key) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _json_kind(value) -> str:
    """The value's class for the overlap of types: null, boolean, int, frac, string, array, object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "int"
    if isinstance(value, float):
        return "frac"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "object")


TYPE_KINDS = {
    "null": {"null"},
    "boolean": {"boolean"},
    "integer": {"int"},
    "number": {"int", "frac"},
    "string": {"string"},
    "array": {"array"},
    "object": {"object"},
}


def _canonical(value) -> str:
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


class _Walk:
    def __init__(self, root):
        self.root, self.count, self.pattern_cost, self.optional, self.walked = root, 0, 0, 0, {"#"}

    def schema(self, node, path: str, depth: int, default_type: str | None = None) -> None:
        self.count += 1
        if self.count > MAX_SUBSCHEMAS:
            raise Refused(f"the schema has more than {MAX_SUBSCHEMAS} subschemas (at {path})")
        if depth > MAX_DEPTH:
            raise Refused(f"subschemas nest deeper than {MAX_DEPTH} levels (at {path})")
        if not isinstance(node, dict):
            return  # true, false and what is no schema: xgrammar's own answer
        for key in node:
            if key in NOT_ENFORCED:
                raise Refused(f"'{key}' at {path} is not enforced: {NOT_ENFORCED[key]}; remove it")
            if key not in KNOWN and not key.startswith("x-"):
                raise Refused(f"unknown keyword '{key}' at {path}: nothing would enforce it; remove it")
        if "$id" in node and path != "#":
            raise Refused(f"'$id' at {path}: xgrammar resolves every $ref from the root; remove it")
        branch = next((k for k in BRANCHES if k in node), None)
        if branch is not None:
            beside = ANNOTATIONS | CONTAINERS | {branch, "$id"} | ({"type"} if branch in ("const", "enum") else set())
            for key in node:
                if key not in beside and not key.startswith("x-"):
                    raise Refused(
                        f"'{key}' beside '{branch}' at {path} is not enforced: xgrammar follows '{branch}' "
                        f"alone; move '{key}' into it or remove it"
                    )
            {
                "$ref": self._ref,
                "const": self._const,
                "enum": self._enum,
                "anyOf": self._anyOf,
                "oneOf": self._oneOf,
                "allOf": self._allOf,
            }[branch](node, path, depth)
            return
        types = self._types(node, default_type)
        if types is None:
            for key in node:
                if key not in ANNOTATIONS | CONTAINERS | {"$id", "type"} and not key.startswith("x-"):
                    raise Refused(
                        f"'{key}' at {path} needs a 'type' beside it: without one xgrammar writes any JSON "
                        "value and ignores it"
                    )
            return
        for name in types:
            check = {
                "integer": self._integer,
                "number": self._number,
                "string": self._string,
                "array": self._array,
                "object": self._object,
            }.get(name)
            if check is not None:
                check(node, path, depth)

    @staticmethod
    def _types(node: dict, default_type: str | None) -> list[str] | None:
        declared = node.get("type", default_type)
        if isinstance(declared, str):
            return [declared]
        if isinstance(declared, list) and declared:
            return [t for t in declared if isinstance(t, str)]
        if declared is None:  # xgrammar's reading of a schema without a type
            if {"properties", "additionalProperties", "unevaluatedProperties"} & set(node):
                return ["object"]
            if {"items", "prefixItems", "unevaluatedItems"} & set(node):
                return ["array"]
        return None

    # ---- one branch each

    def _ref(self, node: dict, path: str, depth: int) -> None:
        target, pointer = self._resolve(node["$ref"], path)
        if pointer is not None and pointer not in self.walked:
            self.walked.add(pointer)
            self.schema(target, pointer, depth + 1)

    def _resolve(self, ref, path: str):
        """A local $ref's target and its pointer; (None, None) where xgrammar reports the error itself."""
        if not isinstance(ref, str):
            return None, None
        if ref != "#" and not ref.startswith("#/"):
            raise Refused(
                f"'$ref' {ref!r} at {path} is not enforced: xgrammar resolves only '#' and '#/...' "
                "(a remote or anchor $ref is written as any JSON value); inline it under $defs"
            )
        target = self.root
        for part in [p for p in ref[2:].split("/") if p]:
            if not isinstance(target, dict) or part not in target:
                return None, None
            target = target[part]
        return target, ref

    def _const(self, node: dict, path: str, depth: int) -> None:
        self._values_fit_type(node, [node["const"]], "const", path)

    def _enum(self, node: dict, path: str, depth: int) -> None:
        if isinstance(node["enum"], list):
            self._values_fit_type(node, node["enum"], "enum", path)

    def _values_fit_type(self, node: dict, values: list, keyword: str, path: str) -> None:
        types = self._types(node, None) if "type" in node else None
        if types is None:
            return
        kinds = set().union(*(TYPE_KINDS.get(t, set()) for t in types))
        for value in values:
            if _json_kind(value) not in kinds:
                raise Refused(
                    f"'{keyword}' value {json.dumps(value)[:60]} at {path} is not of its 'type' "
                    f"{node['type']!r}: xgrammar would write it; drop it or fix the type"
                )

    def _anyOf(self, node: dict, path: str, depth: int) -> None:
        for i, member in enumerate(node["anyOf"] if isinstance(node["anyOf"], list) else []):
            self.schema(member, f"{path}/anyOf/{i}", depth + 1)

    def _oneOf(self, node: dict, path: str, depth: int) -> None:
        members = node["oneOf"] if isinstance(node["oneOf"], list) else []
        for i, member in enumerate(members):
            self.schema(member, f"{path}/oneOf/{i}", depth + 1)
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                if not self._disjoint(members[i], members[j]):
                    raise Refused(
                        f"'oneOf' at {path}: members {i} and {j} may both match one value, and xgrammar "
                        "enforces oneOf as anyOf; make them disjoint (different types, or a required "
                        "property with different const values) or use anyOf"
                    )

    def _allOf(self, node: dict, path: str, depth: int) -> None:
        members = node["allOf"] if isinstance(node["allOf"], list) else []
        if len(members) != 1:
            raise Refused(
                f"'allOf' with {len(members)} members at {path} is not enforced: xgrammar writes any JSON "
                "value for it; merge the members into one schema"
            )
        self.schema(members[0], f"{path}/allOf/0", depth + 1)

    # ---- one type each

    def _integer(self, node: dict, path: str, depth: int) -> None:
        if "multipleOf" not in node or not isinstance(node["multipleOf"], (int, float)) or node["multipleOf"] <= 0:
            return  # xgrammar refuses a multipleOf that is no positive number
        step = node["multipleOf"]
        where = f"'multipleOf' {step} at {path}"
        if not float(step).is_integer() or step > INTEGER_MULTIPLE_MAX:
            raise Refused(
                f"{where} is not enforced: xgrammar enforces an integer multipleOf only when it is a whole "
                f"number up to {INTEGER_MULTIPLE_MAX}"
            )
        low, high = self._integer_range(node)
        if (low is None) != (high is None) or (
            low is not None and high is not None and high - low + 1 > INTEGER_MULTIPLE_RANGE
        ):
            raise Refused(
                f"{where} is not enforced beside this range: xgrammar enforces it without bounds, or "
                f"with both a lower and an upper bound at most {INTEGER_MULTIPLE_RANGE} integers apart"
            )

    @staticmethod
    def _integer_range(node: dict):
        def bound(key, shift, rounding):
            value = node.get(key)
            return rounding(value) + shift if isinstance(value, (int, float)) and math.isfinite(value) else None

        lows = [b for b in (bound("minimum", 0, math.ceil), bound("exclusiveMinimum", 1, math.floor)) if b is not None]
        highs = [
            b for b in (bound("maximum", 0, math.floor), bound("exclusiveMaximum", -1, math.ceil)) if b is not None
        ]
        return (max(lows) if lows else None), (min(highs) if highs else None)

    def _number(self, node: dict, path: str, depth: int) -> None:
        if "multipleOf" in node:
            raise Refused(f"'multipleOf' at {path} is not enforced for type number: xgrammar ignores it")

    def _string(self, node: dict, path: str, depth: int) -> None:
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        if "format" in node:
            if not isinstance(node["format"], str) or node["format"] not in FORMATS:
                raise Refused(
                    f"'format' {node['format']!r} at {path} is not enforced: xgrammar knows only "
                    + ", ".join(sorted(FORMATS))
                )
            for key in ["pattern", *lengths]:
                if key in node:
                    raise Refused(
                        f"'{key}' beside 'format' at {path} is not enforced: xgrammar follows the format alone"
                    )
        if "pattern" in node:
            if lengths:
                raise Refused(
                    f"'{lengths[0]}' beside 'pattern' at {path} is not enforced: xgrammar follows the pattern "
                    "alone; put the length in the pattern"
                )
            self._pattern(node["pattern"], f"'pattern' at {path}")

    def _pattern(self, pattern, where: str) -> None:
        if isinstance(pattern, str):
            self.pattern_cost += _pattern_cost(pattern, where)
            if self.pattern_cost > MAX_PATTERN_COST:
                raise Refused(
                    f"{where}: the patterns' repetitions cost {self.pattern_cost}, over the limit of "
                    f"{MAX_PATTERN_COST} (see docs/serving.md)"
                )

    def _array(self, node: dict, path: str, depth: int) -> None:
        if isinstance(node.get("prefixItems"), list):
            for i, item in enumerate(node["prefixItems"]):
                self.schema(item, f"{path}/prefixItems/{i}", depth + 1)
        if "items" in node:
            self.schema(node["items"], f"{path}/items", depth + 1)
        elif "unevaluatedItems" in node:
            self.schema(node["unevaluatedItems"], f"{path}/unevaluatedItems", depth + 1)

    def _object(self, node: dict, path: str, depth: int) -> None:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = (
            [r for r in node.get("required", []) if isinstance(r, str)]
            if isinstance(node.get("required"), list)
            else []
        )
        for name in required:
            if name not in properties:
                raise Refused(
                    f"'required' {name!r} at {path} is not enforced: xgrammar requires only properties "
                    "listed in 'properties'; add it there"
                )
        optional = len(set(properties) - set(required))
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise Refused(
                f"the object at {path} has {optional} optional properties, over the limit of "
                f"{MAX_OPTIONAL_PROPERTIES} (compile time grows steeply with them; required ones are cheap)"
            )
        self.optional += optional
        if self.optional > MAX_OPTIONAL_TOTAL:
            raise Refused(
                f"the schema's objects have more than {MAX_OPTIONAL_TOTAL} optional properties together (at "
                f"{path}), over the limit (compile time grows steeply with them; required ones are cheap)"
            )
        for name, sub in properties.items():
            self.schema(sub, _pointer(f"{path}/properties", name), depth + 1)
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            for pattern, sub in patterns.items():
                where = f"'patternProperties' {pattern!r} at {path}"
                if properties:  # (whether a pattern matches a listed name is not tried: a regex could take forever)
                    raise Refused(
                        f"{where} beside 'properties' is not enforced on the listed properties (xgrammar checks "
                        "a listed property against 'properties' alone, even where a pattern matches its name); "
                        "remove one"
                    )
                self._pattern(pattern, where)
                self.schema(sub, _pointer(f"{path}/patternProperties", pattern), depth + 1)
        if "propertyNames" in node:
            if properties:
                raise Refused(
                    f"'propertyNames' beside 'properties' at {path} is not enforced on the listed properties' "
                    "names; remove one"
                )
            self.schema(node["propertyNames"], f"{path}/propertyNames", depth + 1, default_type="string")
        if isinstance(node.get("additionalProperties"), dict):
            self.schema(node["additionalProperties"], f"{path}/additionalProperties", depth + 1)
        elif "additionalProperties" not in node and isinstance(node.get("unevaluatedProperties"), dict):
            self.schema(node["unevaluatedProperties"], f"{path}/unevaluatedProperties", depth + 1)

    # ---- oneOf: provably disjoint members

    def _deref(self, node, hops: int = 0):
        while isinstance(node, dict) and "$ref" in node and hops < 32:
            node, _ = self._resolve(node["$ref"], "#")
            hops += 1
        return node

    def _kinds(self, node) -> set[str] | None:
        """The classes of every value `node` accepts (None: it may accept any)."""
        if not isinstance(node, dict):
            return None
        if "const" in node:
            return {_json_kind(node["const"])}
        if isinstance(node.get("enum"), list):
            return {_json_kind(v) for v in node["enum"]}
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if isinstance(types, list) and all(isinstance(t, str) and t in TYPE_KINDS for t in types):
            return set().union(*(TYPE_KINDS[t] for t in types))
        return None

    @staticmethod
    def _values(node) -> set[str] | None:
        if isinstance(node, dict) and "const" in node:
            return {_canonical(node["const"])}
        if isinstance(node, dict) and isinstance(node.get("enum"), list):
            return {_canonical(v) for v in node["enum"]}
        return None

    def _disjoint(self, a, b) -> bool:
        a, b = self._deref(a), self._deref(b)
        kinds_a, kinds_b = self._kinds(a), self._kinds(b)
        if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
            return True
        values_a, values_b = self._values(a), self._values(b)
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
        if kinds_a == {"object"} == kinds_b:  # a required property whose values differ
            props_a, props_b = (n.get("properties") if isinstance(n.get("properties"), dict) else {} for n in (a, b))
            req_a, req_b = ({r for r in n.get("required") or [] if isinstance(r, str)} for n in (a, b))
            both = req_a & req_b & set(props_a) & set(props_b)
            for name in both:
                va, vb = self._values(self._deref(props_a[name])), self._values(self._deref(props_b[name]))
                if va is not None and vb is not None and not va & vb:
                    return True
        return False


_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_WIDE, _WIDER = 8, 28  # what . or [^...], and \W, \S, \D, cost beside a narrow class (measured)


def _pattern_cost(pattern: str, where: str) -> int:
    """The conversion cost of a regular expression's repetitions (each repetition's bound squared,
    times the size of what it repeats), refusing what xgrammar would ignore in it: lookarounds, and
    anchors inside it (only a leading ^ and a trailing $, of the whole or of a top-level alternative)."""
    cost, i, n = 0, 0, len(pattern)
    sizes: list[int] = [0]  # the size of the group being read, one per open group
    last = 0  # the size of the last atom or group (what a quantifier repeats)
    while i < n:
        c = pattern[i]
        if c == "\\":
            last = _WIDER if pattern[i + 1 : i + 2] in ("W", "S", "D") else 1
            sizes[-1] += last
            i += 2
            continue
        if c == "[":
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last = _WIDE if pattern[i + 1 : i + 2] == "^" else 1
            sizes[-1] += last
            i = j + 1
            continue
        if c == "(":
            if pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                raise Refused(f"{where}: xgrammar ignores lookarounds ({pattern[i : i + 4]}...); rewrite without them")
            sizes.append(0)
        elif c == ")":
            last = sizes.pop() if len(sizes) > 1 else 0
            sizes[-1] += last
        elif c == "^" and not (
            re.fullmatch(r"(\((\?:)?)*", pattern[:i]) or (len(sizes) == 1 and pattern[i - 1] == "|")
        ):
            raise Refused(f"{where}: xgrammar ignores '^' inside a pattern (at {i}); anchor only its start")
        elif c == "$" and not (
            re.fullmatch(r"\)*", pattern[i + 1 :]) or (len(sizes) == 1 and pattern[i + 1 : i + 2] == "|")
        ):
            raise Refused(f"{where}: xgrammar ignores '$' inside a pattern (at {i}); anchor only its end")
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            bound = int(m[3]) if m[3] else int(m[1])
            cost += bound * bound * max(last, 1)
            sizes[-1] += last * max(bound - 1, 0)
            i = m.end()
            continue
        elif c not in "|*+?^$":
            last = _WIDE if c == "." else 1
            sizes[-1] += last
        i += 1
    return cost
