# Sourced by the device scripts (device_run.sh, device_engine.sh, device_ab.sh): unpacks the carried
# .device/ (gzipped binaries and the shared libraries they need, made by `device_*.sh pack`) into
# /tmp/kvq-bin and puts its lib/ on LD_LIBRARY_PATH. Returns 1 when no .device/ was carried (the
# caller decides whether an earlier call's /tmp/kvq-bin will do).
kvq_unpack_device() {
  [[ -d .device/bin ]] || return 1
  rm -rf /tmp/kvq-bin && mkdir -p /tmp/kvq-bin/bin /tmp/kvq-bin/lib
  local f
  for f in .device/bin/*.gz; do gunzip -c "$f" >"/tmp/kvq-bin/bin/$(basename "$f" .gz)"; done
  for f in .device/lib/*.gz; do [[ -e $f ]] && gunzip -c "$f" >"/tmp/kvq-bin/lib/$(basename "$f" .gz)"; done
  chmod +x /tmp/kvq-bin/bin/*
  export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}"
}
