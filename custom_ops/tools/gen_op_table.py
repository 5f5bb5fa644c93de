"""Generates the C++ view (op_table_gen.h) of src/dsv4_ort/export/op_table.json, the op-contract table.

The library registers exactly the ops listed there, with the inputs, outputs, types, attributes and shape rules
given there; tests check the built library against the same file. Element types come from the table's
"element_types" (the one type table, read in Python through dsv4_ort.export.schema.ELEMENT_TYPES).

usage: gen_op_table.py op_table.json out.h
"""

import json
import sys

ATTR_KINDS = {"int": "kInt", "float": "kFloat", "string": "kString"}


def cstr(s):
    return json.dumps(s) if s is not None else "nullptr"


def io_entry(io, tvars, codes):
    t = io["type"]
    code = -(list(tvars).index(t) + 1) if t in tvars else codes[t]
    shape = ";".join(str(tok) for tok in io.get("shape", [])) if "shape" in io else None
    return "{%s, %d, %s, %d, %d, %s}" % (
        cstr(io["name"]), code, "true" if io.get("optional") else "false", io.get("rank", -1),
        io.get("min_rank", io.get("rank", 0)), cstr(shape))


def attr_entry(a):
    kind = ATTR_KINDS[a["type"]]
    required = "default" not in a
    d = a.get("default")
    i_def = int(d) if (a["type"] == "int" and d is not None) else 0
    f_def = float(d) if (a["type"] == "float" and d is not None) else 0.0
    s_def = d if a["type"] == "string" else None
    choices = "|".join(a["choices"]) if "choices" in a else None
    return "{%s, AttrKind::%s, %s, %dLL, %r, %s, %s, %r, %s, %r, %s}" % (
        cstr(a["name"]), kind, "true" if required else "false", i_def, f_def, cstr(s_def),
        "true" if "min" in a else "false", float(a.get("min", 0)), "true" if "max" in a else "false",
        float(a.get("max", 0)), cstr(choices))


def main(src, dst):
    with open(src) as f:
        table = json.load(f)
    out = [
        "// Generated from src/dsv4_ort/export/op_table.json by custom_ops/tools/gen_op_table.py. Do not edit.",
        "#pragma once", "", '#include "ops/op_table.h"', "", "namespace dsv4::optable {", "",
        "inline constexpr const char* kDomain = %s;" % cstr(table["domain"]),
        "inline constexpr int kTableVersion = %d;" % table["table_version"],
        "inline constexpr int kOrtApiVersion = %d;" % table["ort_api_version"], "",
    ]
    elem_types = sorted(table["element_types"].items(), key=lambda kv: kv[1]["code"])
    codes = {name: t["code"] for name, t in elem_types}
    out.append("inline constexpr ElementType kElementTypes[] = {%s};" % ", ".join(
        "{%s, %d, %d}" % (cstr(name), t["code"], t["bytes"]) for name, t in elem_types))
    out.append("")
    op_entries = []
    for op in table["ops"]:
        n = op["name"]
        tvars = op.get("type_constraints", {})
        for tv, types in tvars.items():
            out.append("inline constexpr int k%s_tv_%s[] = {%s};" % (n, tv, ", ".join(str(codes[t]) for t in types)))
        if tvars:
            out.append("inline constexpr TypeVar k%s_tvars[] = {%s};" % (
                n, ", ".join("{%s, k%s_tv_%s, %d}" % (cstr(tv), n, tv, len(ts)) for tv, ts in tvars.items())))
        out.append("inline constexpr IoSpec k%s_inputs[] = {%s};" % (n, ", ".join(io_entry(i, tvars, codes) for i in op["inputs"])))
        out.append("inline constexpr IoSpec k%s_outputs[] = {%s};" % (n, ", ".join(io_entry(o, tvars, codes) for o in op["outputs"])))
        if op.get("attributes"):
            out.append("inline constexpr AttrSpec k%s_attrs[] = {%s};" % (n, ", ".join(attr_entry(a) for a in op["attributes"])))
        op_entries.append("  {%s, %d, k%s_inputs, %d, k%s_outputs, %d, %s, %d, %s, %d}," % (
            cstr(n), op["since_version"], n, len(op["inputs"]), n, len(op["outputs"]),
            ("k%s_attrs" % n) if op.get("attributes") else "nullptr", len(op.get("attributes", [])),
            ("k%s_tvars" % n) if tvars else "nullptr", len(tvars)))
        out.append("")
    out.append("inline constexpr OpSpec kOps[] = {")
    out.extend(op_entries)
    out.append("};")
    out.append("inline constexpr int kNumOps = %d;" % len(op_entries))
    out.append("")
    out.append("}  // namespace dsv4::optable")
    text = "\n".join(out) + "\n"
    try:
        with open(dst) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(dst, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
