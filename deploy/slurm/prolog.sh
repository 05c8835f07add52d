#!/bin/sh
# forge_load's Slurm prolog and epilog (epilog.sh is this file under another name): before a job starts, hold
# its GPUs so that the filler there stops and drains; after it ends, release them.
#
#   slurm.conf:  Prolog=/etc/slurm/forge-load-prolog.sh
#                Epilog=/etc/slurm/forge-load-epilog.sh
#                PrologFlags=Alloc
#
# For each GPU of the job (SLURM_JOB_GPUS: Slurm's indices of the node's GPUs) the prolog runs
#   forge-load hold --gpu GPU,... --holder slurm-$SLURM_JOB_ID --reason "Slurm job N" --wait 2
# and the epilog `forge-load release --holder slurm-$SLURM_JOB_ID`. Which of the two runs: SLURM_SCRIPT_CONTEXT
# (prolog_slurmd or epilog_slurmd, set by slurmd), else the script's name (containing "epilog" or not).
#
# Slurm's index i names the i-th `File=` device of gres.conf: the script holds the GPU whose device minor
# number is i (/dev/nvidia<i>), by UUID, from the driver's /proc/driver/nvidia/gpus/*/information; where that
# directory is absent it passes the index, which forge-load resolves through NVML. docs/slurm.md says when
# these numberings agree and how to check.
#
# It fails open, always: it exits 0 whatever happens (a prolog or epilog that fails drains the node), and the
# whole script runs under `timeout`, so a stopped, hung or absent filler, or a missing forge-load, delays the
# job by at most the wait plus one second. It logs one line per job to syslog (tag forge-load-slurm, facility
# daemon; silent where there is no syslog).
#
# Settings, all optional: KEY=value lines in forge-load.conf, read as data, never run. The first of these that
# exists is read: beside slurm.conf (the directory of SLURM_CONF, which slurmd sets), else beside this script
# (its real path: the epilog's link resolved). On a configless node SLURM_CONF names slurmd's cache, which holds
# only what slurmctld sends (slurm.conf, gres.conf, ...), not forge-load.conf: there it is the second,
# /etc/slurm/forge-load.conf for the script installed as /etc/slurm/forge-load-prolog.sh. Each job's line in
# syslog names the file read, or "defaults".
#   FORGE_LOAD                  the forge-load command (default: forge-load on PATH or /opt/forge-load/bin)
#   FORGE_HOLD_DIR              the hold directory (default /run/forge-load/holds, the filler's default)
#   FORGE_SLURM_WAIT_S          seconds to wait for the filler's drain (default 2; 0 to 30)
#   FORGE_SLURM_SYSLOG_SOCKET   the syslog socket (default: logger's, /dev/log)
#   FORGE_SLURM_NVIDIA_PROC     the driver's GPU directory (default /proc/driver/nvidia/gpus; for tests)

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/forge-load/bin
export PATH
TAG=forge-load-slurm

FORGE_LOAD=forge-load
FORGE_HOLD_DIR=/run/forge-load/holds
FORGE_SLURM_WAIT_S=2
FORGE_SLURM_SYSLOG_SOCKET=
FORGE_SLURM_NVIDIA_PROC=/proc/driver/nvidia/gpus

log() {  # log PRIORITY MESSAGE: to syslog, never failing, never blocking for long
    if [ -n "$FORGE_SLURM_SYSLOG_SOCKET" ]; then
        timeout 1 logger -u "$FORGE_SLURM_SYSLOG_SOCKET" -t "$TAG" -p "daemon.$1" -- "$2" >/dev/null 2>&1
    else
        timeout 1 logger -t "$TAG" -p "daemon.$1" -- "$2" >/dev/null 2>&1
    fi
    return 0
}

dir_of() {  # the directory part of a path ("." for a bare name)
    case $1 in */*) printf '%s\n' "${1%/*}" ;; *) printf '.\n' ;; esac
}

settings_file() {  # forge-load.conf beside slurm.conf, else beside this script's real path; empty if neither
    conf=$(dir_of "${SLURM_CONF:-/etc/slurm/slurm.conf}")/forge-load.conf
    if [ ! -r "$conf" ]; then
        self=$(readlink -f -- "$0" 2>/dev/null) || self=
        conf=$(dir_of "${self:-$0}")/forge-load.conf
        [ -r "$conf" ] || conf=
    fi
    printf '%s' "$conf"
}

read_settings() {  # the KEY=value lines of the settings file (see the header); with "say", what is wrong logged
    conf=$(settings_file)
    settings="settings ${conf:-defaults (no forge-load.conf beside SLURM_CONF or the script)}"
    [ -n "$conf" ] || return 0
    ignored=
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in '' | '#'*) continue ;; esac
        key=${line%%=*}
        value=${line#*=}
        case $key in
            FORGE_LOAD) FORGE_LOAD=$value ;;
            FORGE_HOLD_DIR) FORGE_HOLD_DIR=$value ;;
            FORGE_SLURM_WAIT_S) FORGE_SLURM_WAIT_S=$value ;;
            FORGE_SLURM_SYSLOG_SOCKET) FORGE_SLURM_SYSLOG_SOCKET=$value ;;
            FORGE_SLURM_NVIDIA_PROC) FORGE_SLURM_NVIDIA_PROC=$value ;;
            *) ignored="$ignored '$line'" ;;
        esac
    done <"$conf"
    if [ -n "$ignored" ] && [ "${1:-}" = say ]; then  # logged once the socket setting is known
        log warning "$conf: ignored line(s)$ignored (keys: FORGE_LOAD, FORGE_HOLD_DIR, FORGE_SLURM_WAIT_S, FORGE_SLURM_SYSLOG_SOCKET, FORGE_SLURM_NVIDIA_PROC)"
    fi
    case $FORGE_SLURM_WAIT_S in
        '' | *[!0-9.]* | *.*.* | .) bad=1 ;;
        *) bad=$(awk -v w="$FORGE_SLURM_WAIT_S" 'BEGIN { print (w + 0 > 30) ? 1 : 0 }') ;;
    esac
    if [ "$bad" = 1 ]; then
        [ "${1:-}" != say ] || log warning "$conf: FORGE_SLURM_WAIT_S='$FORGE_SLURM_WAIT_S' is not seconds from 0 to 30; waiting 2"
        FORGE_SLURM_WAIT_S=2
    fi
}

gpu_of_index() {  # Slurm's index -> the UUID of the GPU with that device minor, else the index itself
    if [ -d "$FORGE_SLURM_NVIDIA_PROC" ]; then
        uuid=$(awk -F: -v want="$1" '
            FNR == 1 { uuid = ""; minor = "" }
            { sub(/^[ \t]+/, "", $2); sub(/[ \t]+$/, "", $2) }
            $1 == "GPU UUID" { uuid = $2 }
            $1 == "Device Minor" { minor = $2 }
            uuid != "" && minor == want { print uuid; exit }' "$FORGE_SLURM_NVIDIA_PROC"/*/information 2>/dev/null)
        if [ -n "$uuid" ]; then
            printf '%s\n' "$uuid"
            return
        fi
        log warning "job $SLURM_JOB_ID: no GPU with device minor $1 in $FORGE_SLURM_NVIDIA_PROC; holding NVML index $1"
    fi
    printf '%s\n' "$1"
}

job_gpus() {  # SLURM_JOB_GPUS ("0,2" or "0-3") -> "GPU-...,GPU-..." (empty when the job has no GPU)
    out=
    for item in $(printf '%s' "${SLURM_JOB_GPUS:-}" | tr ',' ' '); do
        case $item in
            *[!0-9-]* | -* | *-*-* | *-) log warning "job $SLURM_JOB_ID: SLURM_JOB_GPUS item '$item' is not an index; skipped"; continue ;;
            *-*) indices=$(seq "${item%-*}" "${item#*-}") ;;
            *) indices=$item ;;
        esac
        for i in $indices; do
            out=${out:+$out,}$(gpu_of_index "$i")
        done
    done
    printf '%s' "$out"
}

now_s() { date +%s.%N; }

case ${SLURM_SCRIPT_CONTEXT:-} in
    prolog_slurmd) action=hold ;;
    epilog_slurmd) action=release ;;
    *) case ${0##*/} in *epilog*) action=release ;; *) action=hold ;; esac ;;
esac

if [ "${1:-}" != --guarded ]; then
    # The outer run (as slurmd calls it, with no arguments): the real work runs again under `timeout`, with
    # the start time as argument; whatever it does, this exits 0.
    [ -n "${SLURM_JOB_GPUS:-}" ] || exit 0  # a job without GPUs: nothing held, nothing to release
    read_settings say  # here only: the guarded run below reads them again, quietly
    bound=$(awk -v w="$FORGE_SLURM_WAIT_S" 'BEGIN { print w + 1 }')
    start=$(now_s)
    timeout -s KILL "$bound" "$0" --guarded "$start"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        log warning "job $SLURM_JOB_ID: $action gave up after ${bound} s (forge-load hung?); the job goes on; $settings"
    fi
    exit 0
fi

read_settings
holder=slurm-$SLURM_JOB_ID
if ! command -v "$FORGE_LOAD" >/dev/null 2>&1; then
    log warning "job $SLURM_JOB_ID: no forge-load command ('$FORGE_LOAD'); nothing to $action, the job goes on; $settings"
    exit 0
fi
if [ "$action" = release ]; then
    err=$("$FORGE_LOAD" release --holder "$holder" --hold-dir "$FORGE_HOLD_DIR" 2>&1 >/dev/null)
    rc=$?
    took=$(awk -v a="$2" -v b="$(now_s)" 'BEGIN { printf "%.3f", b - a }')
    if [ "$rc" -eq 0 ]; then
        log info "job $SLURM_JOB_ID: released $holder in ${took} s; $settings"
    else
        log err "job $SLURM_JOB_ID: forge-load release exited $rc after ${took} s: $(printf '%s' "$err" | head -c 300 | tr '\n' ' '); $settings"
    fi
    exit 0
fi
gpus=$(job_gpus)
[ -n "$gpus" ] || exit 0
err=$("$FORGE_LOAD" hold --gpu "$gpus" --holder "$holder" --reason "Slurm job $SLURM_JOB_ID" \
    --wait "$FORGE_SLURM_WAIT_S" --hold-dir "$FORGE_HOLD_DIR" 2>&1 >/dev/null)
rc=$?
took=$(awk -v a="$2" -v b="$(now_s)" 'BEGIN { printf "%.3f", b - a }')
case $rc in
    0) log info "job $SLURM_JOB_ID: held GPU $gpus as $holder in ${took} s (its filler drained, or none runs there); $settings" ;;
    1) log warning "job $SLURM_JOB_ID: held GPU $gpus as $holder, no drain acknowledged within ${FORGE_SLURM_WAIT_S} s; the job starts anyway; $settings" ;;
    *) log err "job $SLURM_JOB_ID: forge-load hold exited $rc after ${took} s: $(printf '%s' "$err" | head -c 300 | tr '\n' ' '); the job starts anyway; $settings" ;;
esac
exit 0
