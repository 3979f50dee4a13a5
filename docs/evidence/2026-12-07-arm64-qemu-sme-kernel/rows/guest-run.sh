set -u
mkdir -p /root/dlprof-agent && cd /root/dlprof-agent && tar -xf /out/checkout.tar
rm -f /out/checkout.tar
if [ -b /dev/vdb ] && mkdir -p /roots && mount /dev/vdb /roots; then
    export DLPROF_PYTHON_ROOTS=/roots; fi
export DLPROF_EVIDENCE=/out
env DLPROF_ARM64_STEPS=machine\ reach\ reach313\ tests313\ noharm DLPROF_ARM64_KINDS=pinned sh scripts/arm64-guest-checks 
