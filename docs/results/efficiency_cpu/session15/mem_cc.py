import sys, json
sys.path.insert(0, "benchmarks")  # run from the repository root
import bench_efficiency as be
KVM = be.KVM
for cc in (4, 3, 2):
    be.MIXERS[f"kvm-256/c{cc}"] = ("kvm", dict(KVM, schedule={"name": "fixed", "size": 256}, checkpoint_chunks=cc))
    be.MIXERS[f"kvm-sqrt/c{cc}"] = ("kvm", dict(KVM, schedule={"name": "power_law", "coef": 16, "exponent": 0.5, "min_size": 256}, checkpoint_chunks=cc))
task = json.loads(sys.argv[1])
print(json.dumps(be.worker(task)))
