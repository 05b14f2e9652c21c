#!/usr/bin/env bash
# Copies include/ (and nothing else of the project) into an empty folder and builds and runs tests/vendored/main.cpp
# against it with `-I` alone, as a trainer that vendors the headers does. usage: run.sh CXX SOURCE_DIR
set -euo pipefail
cxx=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/third_party/foremoe"
cp -r "$src/include" "$work/third_party/foremoe/"
cp "$src/tests/vendored/main.cpp" "$work/trainer.cpp"
cd "$work"
"$cxx" -std=c++20 -O1 -pthread -I third_party/foremoe/include trainer.cpp -o trainer
./trainer
