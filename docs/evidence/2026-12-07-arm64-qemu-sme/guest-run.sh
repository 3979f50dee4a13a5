set -u
mkdir -p /root/dlprof-agent && cd /root/dlprof-agent && tar -xf /out/checkout.tar
rm -f /out/checkout.tar
if [ -b /dev/vdb ] && mkdir -p /roots && mount /dev/vdb /roots; then
    export DLPROF_PYTHON_ROOTS=/roots; fi
export DLPROF_EVIDENCE=/out
sh -c $'out=$DLPROF_EVIDENCE\n{ uname -srm; grep -m1 \'^Features\' /proc/cpuinfo\n  for f in /proc/sys/abi/sve_default_vector_length /proc/sys/abi/sme_default_vector_length; do [ -e "$f" ] && echo "$(basename $f): $(cat $f)"; done\n  python3 -c \'import sys; print("python", sys.version.split()[0])\'; } | tee "$out/machine.txt"\necho "== register state ($(date -u +%T))"\npython3 -m pytest -q -rs -p no:cacheprovider tests/test_register_state_arm64.py tests/test_arm64_frame.py 2>&1 | tee "$out/register-state.txt"\necho "== 3.13 gdb tests ($(date -u +%T))"\npython3 -m pytest -q -rs -p no:cacheprovider tests/test_trixie_root.py -k gdb 2>&1 | tee "$out/trixie-gdb-tests.txt"\necho "== no harm: sleep, gdb ($(date -u +%T))"\npython3 -m benchmarks.no_harm --out "$out/no-harm.md" --attaches 2 --kills 6 --injectors gdb --scale 0.05 sleep\necho "== done ($(date -u +%T))"' 
