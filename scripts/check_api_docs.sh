#!/usr/bin/env bash
# check_api_docs.sh: builds the API reference (Doxygen, docs/api/Doxyfile) from the public headers
# include/dtrain/**/*.h and fails when a public declaration has no documentation or a comment is
# malformed. Run by scripts/check_structure.sh (its api-docs check), so by CI.
#
# Public: everything in include/dtrain but private members and what the Doxyfile's EXCLUDE_SYMBOLS
# names (the detail namespace, the NCCL test seam, pimpl structs, helper macros). A /// summary of
# one sentence is enough (@param is not required). Doxygen reports undocumented classes, functions,
# aliases, variables, data members and macros itself (labelled "error:", as WARN_AS_ERROR makes it);
# doxygen 1.9.4 does not report undocumented enum values or dtrain's namespaces, which this script finds in
# Doxygen's XML (written to a temporary directory, not to OUT_DIR).
#
# Usage: scripts/check_api_docs.sh [OUT_DIR]
#   OUT_DIR  where html/ goes (default: $DTRAIN_API_OUT, else <repo>/build/api); made if missing
# Prints each problem as file:line: message and then one summary line:
#   api docs: N undocumented or malformed declarations                 (exit 1)
#   api docs: all public declarations documented (HTML in OUT_DIR)     (exit 0)
# Exit 2 when doxygen is not installed (scripts/setup.sh installs it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${DTRAIN_API_OUT:-$root/build/api}}
if ! command -v doxygen >/dev/null; then
  echo "check_api_docs.sh: doxygen not found: install it (apt-get install doxygen, or bash scripts/setup.sh)" >&2
  echo "api docs: not checked: doxygen is not installed"
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cd "$root"

# The Doxyfile as committed, with the output directory given here and XML for the second pass.
rc=0
{
  cat docs/api/Doxyfile
  echo "OUTPUT_DIRECTORY = \"$out\""
  echo "GENERATE_XML = YES"
  echo "XML_OUTPUT = \"$tmp/xml\""
  echo "XML_PROGRAMLISTING = NO"
} | doxygen - >"$tmp/stdout" 2>"$tmp/doxygen" || rc=$?

# Enum values and namespaces without any documentation, in Doxygen's format.
[[ -d $tmp/xml ]] && /usr/bin/python3 - "$tmp/xml" "$root" >>"$tmp/doxygen" <<'PY'
import glob, os, sys
import xml.etree.ElementTree as ET
xmldir, root = sys.argv[1], sys.argv[2]
def documented(e):
    return any("".join(e.find(t).itertext()).strip() for t in ("briefdescription", "detaileddescription")
               if e.find(t) is not None)
def where(loc):
    f = loc.get("file", "?")
    return (os.path.join(root, f) if not os.path.isabs(f) else f), int(loc.get("line", "0"))
seen = set()
for path in sorted(glob.glob(os.path.join(xmldir, "*.xml"))):
    if os.path.basename(path) == "index.xml":
        continue
    for cd in ET.parse(path).getroot().iter("compounddef"):
        name = cd.findtext("compoundname") or ""
        if cd.get("kind") == "namespace" and name.split("::")[0] == "dtrain" and not documented(cd):
            f, line = where(cd.find("location"))
            print(f"{f}:{line}: error: Namespace {name} is not documented.")
        for md in cd.iter("memberdef"):
            if md.get("kind") != "enum" or md.get("prot") == "private":
                continue
            f, line = where(md.find("location"))
            try:
                text = open(f, errors="replace").read().split("\n")
            except OSError:
                text = []
            for ev in md.findall("enumvalue"):
                name = ev.findtext("name")
                if documented(ev) or (f, name) in seen:
                    continue
                seen.add((f, name))
                # Enum values carry no location: the first line from the enum's on that names the value.
                at = next((i + 1 for i in range(max(line - 1, 0), len(text))
                           if name in text[i].replace("///", "//").split("//")[0]), line)
                print(f"{f}:{at}: error: Member {name} (enumvalue) of enum {md.findtext('qualifiedname')} "
                      "is not documented.")
PY

# Each message once (doxygen repeats a namespace member's for its file), paths from the repository root.
sed "s|^$root/||" "$tmp/doxygen" | awk 'NF && !seen[$0]++' >"$tmp/problems"
n=$(grep -cE '(^|: )(warning|error): ' "$tmp/problems" || true)
cat "$tmp/problems"
if ((n > 0)); then
  echo "api docs: $n undocumented or malformed declarations"
  exit 1
fi
if ((rc != 0)); then
  cat "$tmp/stdout"
  echo "api docs: doxygen failed (exit $rc) without a message"
  exit 1
fi
echo "api docs: all public declarations documented (HTML in ${out#"$root"/}/html)"
