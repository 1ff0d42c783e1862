source bench/scripts/lib.sh
out=$OUT
here=$(pwd)
mkdir -p /tmp/oldrun && cp -r old-tree/kernels /tmp/oldrun/ && for d in ep_runtime launch topology bench; do ln -sf $here/$d /tmp/oldrun/$d; done
K="python3 -m ep_runtime.cli bench kernels --ops weighted_reduce_fp8 --kernel-time --skip-compile --warm-cache --shapes small"
R="python3 bench/scripts/reduce_vectors.py --tokens 128 --dtypes e4m3 --positions layout"
for i in 1 2; do
  LIMIT=100 run new-$i $K --commit 0f516bd --out $out/new-$i.json
  cd /tmp/oldrun && python3 -c "import kernels; print('old kernels from', kernels.__file__)" && LIMIT=100 run old-$i $K --commit 5067704 --out $out/old-$i.json; cd $here
  LIMIT=60 run newr-$i $R
  cd /tmp/oldrun && LIMIT=60 run oldr-$i $R; cd $here
done
for f in new-1 old-1 new-2 old-2; do echo "## $f"; grep -E "GPU time speedup|ours " $out/$f.log; done
for f in newr-1 oldr-1 newr-2 oldr-2; do echo "## $f"; grep -E "^T=" $out/$f.log; done
pack call6
