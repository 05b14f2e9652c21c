#!/usr/bin/env bash
# Lint: `clang-format-14 --dry-run -Werror` on every tracked C++ file, then clang-tidy-14 (.clang-tidy) on
# the project's translation units from a configured build's compile database (CUDA files excluded).
#
#   scripts/lint.sh [--build-dir DIR] [--all [--record] | --since REF | --changed [REF]] [--no-format] [--no-tidy]
#                   [--list] [-j N]
#
#   --all            clang-tidy on every project TU (the default); the public headers through one TU per header-check
#                    target that includes them all (the same findings as one TU per header)
#   --record         with --all, or with --since the commit already in .ci/tidy-clean, on a clean tree and no finding:
#                    writes HEAD's commit into .ci/tidy-clean, the commit that CI's --since starts from (commit that
#                    file). --since that commit checks every TU a change since a clean commit can affect, so HEAD is
#                    then clean as a whole, without the full run's half hour
#   --since REF      what CI runs (REF: the commit in .ci/tidy-clean): clang-tidy on every TU that a change since REF
#                    can affect, read from the built tree's dependency records (`ninja -t deps`): a TU whose source or
#                    any file it includes changed, every TU not built yet, and all of them when the compile flags or
#                    the checks may have changed (CMake files, presets, .clang-tidy, this script) or REF is unknown
#   --changed [REF]  only the TUs touched since merge-base(REF, HEAD) (default REF: main), working tree
#                    included: a changed .cpp is its own TU, a changed public header its header-check TU
#                    (tests/CMakeLists.txt), a changed private header (runtime/, tools/, tests/, ...) every
#                    TU in its folder
#   --list           print the TUs clang-tidy would check, and stop
#   --build-dir DIR  the configured build with compile_commands.json (default build/ci: `cmake --preset ci`)
#
# Needs clang-tidy-14 and clang-format-14 (scripts/install-deps.sh --ci). Exit 1 on any finding.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

build=build/ci mode=all ref=main do_format=1 do_tidy=1 record=0 list_only=0 jobs=$(nproc)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build=$2; shift 2 ;;
    --all) mode=all; shift ;;
    --record) record=1; shift ;;
    --since)
      [[ $# -ge 2 ]] || { echo "lint.sh: --since needs a commit" >&2; exit 2; }
      mode=since; ref=$2; shift 2 ;;
    --changed)
      mode=changed; shift
      if [[ $# -gt 0 && "$1" != -* ]]; then ref=$1; shift; fi ;;
    --no-format) do_format=0; shift ;;
    --no-tidy) do_tidy=0; shift ;;
    --list) list_only=1; shift ;;
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
  deps_file=$(mktemp)
  trap 'rm -f "$changed_file" "$deps_file"' EXIT
  if [[ $mode == changed ]]; then
    base=$(git merge-base "$ref" HEAD) || { echo "lint: no merge-base with '$ref'" >&2; exit 2; }
    { git diff --name-only "$base" --; git ls-files --others --exclude-standard; } | sort -u >"$changed_file"
  elif [[ $mode == since ]]; then
    if git cat-file -e "${ref}^{commit}" 2>/dev/null; then
      { git diff --name-only "$ref" --; git ls-files --others --exclude-standard; } | sort -u >"$changed_file"
      ninja -C "$build" -t deps >"$deps_file"
    else
      echo "lint: commit '$ref' is not in this clone: clang-tidy on every TU"
      mode=all
    fi
  fi
  # Picks the TUs: project sources only (no CUDA, no fetched dependencies), as absolute paths.
  mapfile -t tus < <(python3 - "$db" "$root" "$mode" "$changed_file" "$deps_file" <<'EOF'
import json, os, re, shlex, sys
db, root, mode, changed_file, deps_file = sys.argv[1:]
entries = [e for e in json.load(open(db)) if not e["file"].endswith(".cu")]
files = sorted({os.path.normpath(os.path.join(e["directory"], e["file"])) for e in entries})
files = [f for f in files if f.startswith(root + os.sep) and "/_deps/" not in f]
# A header-check folder's all_headers.cpp holds every one of its headers: it stands for the one-header TUs,
# which would analyse each header again for every header that includes it (cmake/HeaderChecks.cmake).
combined = {os.path.dirname(f) for f in files if os.path.basename(f) == "all_headers.cpp"}
whole = [f for f in files if os.path.dirname(f) not in combined or f.endswith("/all_headers.cpp")]
changed = [l.strip() for l in open(changed_file) if l.strip()]
global_inputs = ("CMakeLists.txt", "CMakePresets.json", ".clang-tidy", "scripts/lint.sh")
if mode == "since" and any(c.endswith(global_inputs) or c.startswith("cmake/") or c.endswith(".cmake") for c in changed):
    sys.stderr.write("lint: a build file, the checks or this script changed: every TU\n")
    mode = "all"
if mode == "all":
    print("\n".join(whole))
    sys.exit(0)
if mode == "since":
    # Object -> its recorded inputs, from `ninja -t deps` ("obj: #deps N, ..." then indented paths).
    build_dir = os.path.dirname(os.path.abspath(db))
    deps, current = {}, None
    for line in open(deps_file):
        if line.startswith((" ", "\t")):
            if current is not None and line.strip():
                deps[current].add(os.path.normpath(os.path.join(build_dir, line.strip())))
        elif line.strip():
            current = os.path.normpath(os.path.join(build_dir, line.split(":")[0]))
            deps[current] = set()
    changed_abs = {os.path.join(root, c) for c in changed}
    pick = []
    for e in entries:
        src = os.path.normpath(os.path.join(e["directory"], e["file"]))
        if src not in whole:
            continue
        args = shlex.split(e["command"])
        obj = os.path.normpath(os.path.join(e["directory"], args[args.index("-o") + 1])) if "-o" in args else None
        inputs = deps.get(obj)
        # Not built yet (no record): checked, as nothing says what it includes.
        if inputs is None or src in changed_abs or inputs & changed_abs:
            pick.append(src)
    print("\n".join(sorted(set(pick))))
    sys.exit(0)
pick = set()
for c in changed:
    path = os.path.join(root, c)
    if c.endswith((".cpp", ".cc")) and path in files:
        pick.add(path)
    elif c.endswith((".cpp", ".cc")):  # compiled inside a CMake unity source: that source is its TU
        for f in files:
            if "/Unity/unity_" in f and os.path.exists(f) and f'#include "{path}"' in open(f).read():
                pick.add(f)
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
  if [[ $list_only -eq 1 ]]; then
    printf '%s\n' "${tus[@]}"
    exit 0
  fi
  if [[ ${#tus[@]} -eq 0 || -z "${tus[0]:-}" ]]; then
    echo "lint: clang-tidy: no translation units to check ($mode)"
  else
    echo "lint: clang-tidy-14 on ${#tus[@]} translation units ($mode, -j $jobs)"
    start=$(date +%s)
    # One clang-tidy per TU, output kept per TU so parallel runs do not interleave. A unity source that CMake
    # generated (Unity/unity_*.cxx: tools/, the grouped tests) includes its .cpp files by design, so the check that
    # flags a .cpp include is off for it; the included files' findings are reported (.clang-tidy's header filter).
    if ! printf '%s\0' "${tus[@]}" | xargs -0 -P "$jobs" -I{} bash -c \
      'extra=(); [[ $2 == */Unity/unity_* ]] && extra=(--checks=-bugprone-suspicious-include)
       out=$(clang-tidy-14 -p "$1" --quiet "${extra[@]}" "$2" 2>&1) || { printf "%s\n" "$out"; exit 1; }' \
      _ "$build" {}; then
      echo "lint: clang-tidy found problems (above)" >&2
      status=1
    fi
    echo "lint: clang-tidy took $(( $(date +%s) - start )) s"
  fi
  if [[ $record -eq 1 ]]; then
    recorded=$(cat .ci/tidy-clean 2>/dev/null || true)
    if [[ $status -ne 0 || ( $mode != all && ( $mode != since || -z "$recorded" ||
          "$(git rev-parse -q --verify "${ref}^{commit}" || true)" != "$recorded" ) ) ]]; then
      echo "lint: --record: nothing written (it needs no finding, and --all or --since the commit in .ci/tidy-clean)" >&2
    elif [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
      echo "lint: --record: nothing written: the tree has uncommitted changes, so HEAD is not what was checked" >&2
    else
      git rev-parse HEAD >.ci/tidy-clean
      echo "lint: recorded $(cat .ci/tidy-clean) in .ci/tidy-clean; commit it"
    fi
  fi
fi
exit $status
