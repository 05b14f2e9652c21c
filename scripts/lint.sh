#!/usr/bin/env bash
# Lint: `clang-format-14 --dry-run -Werror` on every tracked C++ file, then clang-tidy-14 (.clang-tidy) on
# the project's translation units from a configured build's compile database (CUDA files excluded).
#
#   scripts/lint.sh [--build-dir DIR] [--all | --changed [REF]] [--no-format] [--no-tidy] [-j N]
#
#   --all            clang-tidy on every project TU (the default; what CI runs); the public headers through one TU per
#                    header-check target that includes them all (the same findings as one TU per header)
#   --changed [REF]  only the TUs touched since merge-base(REF, HEAD) (default REF: main), working tree
#                    included: a changed .cpp is its own TU, a changed public header its header-check TU
#                    (tests/CMakeLists.txt), a changed private header (runtime/, tools/, tests/, ...) every
#                    TU in its folder
#   --build-dir DIR  the configured build with compile_commands.json (default build/ci: `cmake --preset ci`)
#
# Needs clang-tidy-14 and clang-format-14 (scripts/install-deps.sh --ci). Exit 1 on any finding.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

build=build/ci mode=all ref=main do_format=1 do_tidy=1 jobs=$(nproc)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build=$2; shift 2 ;;
    --all) mode=all; shift ;;
    --changed)
      mode=changed; shift
      if [[ $# -gt 0 && "$1" != -* ]]; then ref=$1; shift; fi ;;
    --no-format) do_format=0; shift ;;
    --no-tidy) do_tidy=0; shift ;;
    -j) jobs=$2; shift 2 ;;
    *) echo "lint.sh: unknown argument '$1' (see the header of scripts/lint.sh)" >&2; exit 2 ;;
  esac
done

status=0
if [[ $do_format -eq 1 ]]; then
  mapfile -t cxx < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh')
  echo "lint: clang-format-14 --dry-run -Werror on ${#cxx[@]} files"
  if ! clang-format-14 --dry-run -Werror "${cxx[@]}"; then
    echo "lint: formatting differs; fix with: git ls-files '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh' | xargs clang-format-14 -i" >&2
    status=1
  fi
fi

if [[ $do_tidy -eq 1 ]]; then
  db="$build/compile_commands.json"
  [[ -f "$db" ]] || { echo "lint: no $db; configure first (cmake --preset ci)" >&2; exit 2; }
  changed_file=$(mktemp)
  trap 'rm -f "$changed_file"' EXIT
  if [[ $mode == changed ]]; then
    base=$(git merge-base "$ref" HEAD) || { echo "lint: no merge-base with '$ref'" >&2; exit 2; }
    { git diff --name-only "$base" --; git ls-files --others --exclude-standard; } | sort -u >"$changed_file"
  fi
  # Picks the TUs: project sources only (no CUDA, no fetched dependencies), as absolute paths.
  mapfile -t tus < <(python3 - "$db" "$root" "$mode" "$changed_file" <<'EOF'
import json, os, re, sys
db, root, mode, changed_file = sys.argv[1:]
entries = [e for e in json.load(open(db)) if not e["file"].endswith(".cu")]
files = sorted({os.path.normpath(os.path.join(e["directory"], e["file"])) for e in entries})
files = [f for f in files if f.startswith(root + os.sep) and "/_deps/" not in f]
if mode == "all":
    # A header-check folder's all_headers.cpp holds every one of its headers: it stands for the one-header TUs,
    # which would analyse each header again for every header that includes it (cmake/HeaderChecks.cmake).
    combined = {os.path.dirname(f) for f in files if os.path.basename(f) == "all_headers.cpp"}
    print("\n".join(f for f in files if os.path.dirname(f) not in combined or f.endswith("/all_headers.cpp")))
    sys.exit(0)
changed = [l.strip() for l in open(changed_file) if l.strip()]
pick = set()
for c in changed:
    path = os.path.join(root, c)
    if c.endswith((".cpp", ".cc")) and path in files:
        pick.add(path)
    elif c.startswith("include/") and c.endswith(".hpp"):
        # The header-check TU of foremoe/x/y.hpp is <id>.cpp, id = CMake's MAKE_C_IDENTIFIER of the path.
        ident = re.sub(r"[^A-Za-z0-9_]", "_", c[len("include/"):]) + ".cpp"
        pick.update(f for f in files if os.path.basename(f) == ident and "_header_checks" in f)
    elif c.endswith((".hpp", ".h")):
        folder = os.path.dirname(path) + os.sep
        pick.update(f for f in files if f.startswith(folder))
print("\n".join(sorted(pick)))
EOF
  )
  if [[ ${#tus[@]} -eq 0 || -z "${tus[0]:-}" ]]; then
    echo "lint: clang-tidy: no translation units to check ($mode)"
  else
    echo "lint: clang-tidy-14 on ${#tus[@]} translation units ($mode, -j $jobs)"
    start=$(date +%s)
    # One clang-tidy per TU, output kept per TU so parallel runs do not interleave.
    if ! printf '%s\0' "${tus[@]}" | xargs -0 -P "$jobs" -I{} bash -c \
      'out=$(clang-tidy-14 -p "$1" --quiet "$2" 2>&1) || { printf "%s\n" "$out"; exit 1; }' _ "$build" {}; then
      echo "lint: clang-tidy found problems (above)" >&2
      status=1
    fi
    echo "lint: clang-tidy took $(( $(date +%s) - start )) s"
  fi
fi
exit $status
