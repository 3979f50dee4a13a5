set -u
mkdir -p /root/dlprof-agent && cd /root/dlprof-agent && tar -xf /out/checkout.tar
rm -f /out/checkout.tar
if [ -b /dev/vdb ] && mkdir -p /roots && mount /dev/vdb /roots; then
    export DLPROF_PYTHON_ROOTS=/roots; fi
export DLPROF_EVIDENCE=/out
python3 -m benchmarks.no_harm --out /out/no-harm.md --attaches 4 --kills 20 --injectors default --scale 0.01 openmp 
