# Source in a device call: replace src/, benchmarks/ and configs/ of this copy of the tree by the carried
# snapshot (.carry/snap, kept in /root/snap for the next calls on the same warm machine).
if [ -d .carry/snap ]; then rm -rf /root/snap && cp -r .carry/snap /root/snap; fi
if [ -d /root/snap ]; then
  rm -rf src benchmarks && cp -r /root/snap/src /root/snap/benchmarks .
  if [ -d /root/snap/configs ]; then rm -rf configs && cp -r /root/snap/configs .; fi
  echo "code: snapshot of commit $(cat /root/snap/COMMIT)"
else
  echo "no snapshot: running the tree as sent"
fi
