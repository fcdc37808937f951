#!/bin/bash
# What outlives a device call: `look` lists processes, GPU users, memory and disks; `spawn` leaves
# three sleepers (plain background, own process group holding CUDA memory as vLLM's workers under
# eyas do, own session); `hang` spawns, then outlives the call's limit. Usage: leftovers.sh WHAT...
for what in "$@"; do
  echo "== $what $(date +%T)"
  case $what in
    look)
      # user processes only (kernel threads are pid 2 and its children)
      ps -eo pid,ppid,pgid,sid,stat,etime,rss,args --sort=pid | awk 'NR == 1 || ($1 != 2 && $2 != 2)' |
        grep -v -e " ps -eo" -e " awk NR" | cut -c1-160
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
      free -g | head -2; df -h / /tmp /root /dev/shm 2>&1 | sort -u ;;
    spawn|hang)
      sleep 900 &
      python3 -c "import os,time,torch; os.setpgid(0,0); x=torch.ones(2**28,device='cuda'); torch.cuda.synchronize(); time.sleep(900)" &
      setsid sleep 901 < /dev/null > /dev/null 2>&1 &
      sleep 20; ps -eo pid,pgid,sid,etime,args | grep -E "sleep 90|setpgid" | grep -v grep
      [ "$what" = hang ] && sleep 600 ;;
  esac
done
