# Second GPU call (source it): finish the GGUF, install gguf/ijson, convert the target once.
set -e
cp .carry/c1/* /root/m/
[ -f /root/m/smol.gguf ] || cat /root/m/smol.parta? > /root/m/smol.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/m/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache
python3 -c "from eyas.target import resolve_target; print(resolve_target('/root/m/smol.gguf').path)" \
  2>/dev/null | tail -1 > /root/m/target_path
export EYAS_GPU_TARGET=$(cat /root/m/target_path)
echo "target: $EYAS_GPU_TARGET"
set +e
