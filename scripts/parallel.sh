# Sourced by the scripts that run independent checks side by side.
#
#   each_in_parallel FUNCTION ITEM...
# runs `FUNCTION ITEM` for every item, as many at once as there are cores (at
# most 4); returns non-zero if any of them did.
each_in_parallel() {
  local fn=$1
  shift
  local jobs
  jobs=$(nproc)
  [ "$jobs" -gt 4 ] && jobs=4
  local failed=0 running=0 item
  for item in "$@"; do
    if [ "$running" -ge "$jobs" ]; then
      wait -n || failed=1
      running=$((running - 1))
    fi
    "$fn" "$item" &
    running=$((running + 1))
  done
  while [ "$running" -gt 0 ]; do
    wait -n || failed=1
    running=$((running - 1))
  done
  return $failed
}
