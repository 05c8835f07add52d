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
# and the epilog `forge-load release --holder slurm-$SLURM_JOB_ID`, which releases whatever the prolog held.
# Which of the two runs: SLURM_SCRIPT_CONTEXT (prolog_slurmd or epilog_slurmd, set by slurmd), else the
# script's name (containing "epilog" or not).
#
# Which GPU: Slurm writes SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES entry by entry for the same devices. Where
# the i-th CUDA_VISIBLE_DEVICES entry is a UUID (MIG-... for a MIG device; GPU-... where Slurm knows a whole
# GPU's), that device is held by it. Otherwise (an index there, or the variable missing or of another length,
# said in one line) Slurm's index i names the i-th `File=` device of gres.conf: the script holds the GPU whose
# device minor number is i (/dev/nvidia<i>), by UUID, from the driver's /proc/driver/nvidia/gpus/*/information;
# where that directory is absent it passes the index, which forge-load resolves through NVML. docs/slurm.md
# says when these numberings agree and how to check. The job's syslog line names what forge-load says it held,
# and every GPU of the job it did not hold.
#
# It fails open, always: it exits 0 whatever happens (a prolog or epilog that fails drains the node), within
# its bound, FORGE_SLURM_WAIT_S + 1 s from its start (3 s by default), whatever blocks. What can block runs in
# a child under `timeout -s KILL`, in three phases that share the bound: reading the settings (0.5 s at most:
# a FIFO, or a file on a hung network file system, gets the defaults), the hold or release (until 0.3 s before
# the bound; forge-load's --wait is cut to fit), and the syslog lines (what is left, 0.3 s at most: a socket
# that does not drain costs that, and the lines are lost). It logs one line per job to syslog, and one per
# kind of problem (tag forge-load-slurm, facility daemon; silent where there is no syslog), all at its end by
# one logger.
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

set -f  # SLURM_JOB_GPUS and the settings are data: no word of them is ever a file name pattern
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/forge-load/bin
export PATH
TAG=forge-load-slurm
SETTINGS_S=0.5  # a local forge-load.conf answers in milliseconds
LOG_S=0.3       # the syslog lines, sent at the end: the hold or release phase ends this long before the bound
PYTHON_S=0.5    # forge-load's start and answer: its --wait is cut so that it answers before its phase ends
EXIT_S=0.05     # the shell's own start (before $start) and exit, kept out of the last phase
NL='
'

FORGE_LOAD=forge-load
FORGE_HOLD_DIR=/run/forge-load/holds
FORGE_SLURM_WAIT_S=2
FORGE_SLURM_SYSLOG_SOCKET=
FORGE_SLURM_NVIDIA_PROC=/proc/driver/nvidia/gpus
KEYS="FORGE_LOAD, FORGE_HOLD_DIR, FORGE_SLURM_WAIT_S, FORGE_SLURM_SYSLOG_SOCKET, FORGE_SLURM_NVIDIA_PROC"

say() {  # say PRIORITY MESSAGE: one syslog line on stdout, as `logger --prio-prefix` reads it (facility daemon)
    case $1 in err) n=27 ;; warning) n=28 ;; *) n=30 ;; esac
    printf '<%s>%s\n' "$n" "$(printf '%s' "$2" | tr '\n\r' '  ')"
}

now_s() { date +%s.%N; }

since() {  # seconds from $1 to now
    awk -v a="$1" -v b="$(now_s)" 'BEGIN { printf "%.3f", b - a }'
}

left_before() {  # seconds from now until $1 less $2, at most $3; empty when none are left (`timeout 0` never ends)
    awk -v d="$1" -v r="$2" -v m="$3" -v n="$(now_s)" \
        'BEGIN { s = d - r - n; if (m != "" && s > m) s = m; if (s >= 0.01) printf "%.3f", s }'
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

set_setting() {  # $1=$2 for a key forge-load.conf may give ($KEYS); 1 for any other key
    case $1 in
        FORGE_LOAD) FORGE_LOAD=$2 ;;
        FORGE_HOLD_DIR) FORGE_HOLD_DIR=$2 ;;
        FORGE_SLURM_WAIT_S) FORGE_SLURM_WAIT_S=$2 ;;
        FORGE_SLURM_SYSLOG_SOCKET) FORGE_SLURM_SYSLOG_SOCKET=$2 ;;
        FORGE_SLURM_NVIDIA_PROC) FORGE_SLURM_NVIDIA_PROC=$2 ;;
        *) return 1 ;;
    esac
}

print_settings() {  # `$0 --settings`, run under timeout: the file's name, what is wrong in it, then the settings
    conf=$(settings_file)
    printf 'conf %s\n' "$conf"  # first: should the read below block, the caller can still name the file
    [ -n "$conf" ] || return 0
    ignored=
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in '' | '#'*) continue ;; esac
        set_setting "${line%%=*}" "${line#*=}" || ignored="$ignored '$line'"
    done <"$conf"
    [ -z "$ignored" ] || say warning "$conf: ignored line(s)$ignored (keys: $KEYS)"
    case $FORGE_SLURM_WAIT_S in
        '' | *[!0-9.]* | *.*.* | .) bad=1 ;;
        *) bad=$(awk -v w="$FORGE_SLURM_WAIT_S" 'BEGIN { print (w + 0 > 30) ? 1 : 0 }') ;;
    esac
    if [ "$bad" = 1 ]; then
        say warning "$conf: FORGE_SLURM_WAIT_S='$FORGE_SLURM_WAIT_S' is not seconds from 0 to 30; waiting 2"
        FORGE_SLURM_WAIT_S=2
    fi
    printf 'set FORGE_LOAD %s\nset FORGE_HOLD_DIR %s\nset FORGE_SLURM_WAIT_S %s\n' \
        "$FORGE_LOAD" "$FORGE_HOLD_DIR" "$FORGE_SLURM_WAIT_S"
    printf 'set FORGE_SLURM_SYSLOG_SOCKET %s\nset FORGE_SLURM_NVIDIA_PROC %s\n' \
        "$FORGE_SLURM_SYSLOG_SOCKET" "$FORGE_SLURM_NVIDIA_PROC"
}

gpu_of_index() {  # Slurm's index -> $gpu: the UUID of the GPU with that device minor, else the index itself
    gpu=$1
    [ -d "$FORGE_SLURM_NVIDIA_PROC" ] || return 0
    # set +f in this subshell only: the driver's directories are the one pattern the script expands
    uuid=$(set +f; awk -F: -v want="$1" '
        FNR == 1 { uuid = ""; minor = "" }
        { sub(/^[ \t]+/, "", $2); sub(/[ \t]+$/, "", $2) }
        $1 == "GPU UUID" { uuid = $2 }
        $1 == "Device Minor" { minor = $2 }
        uuid != "" && minor == want { print uuid; exit }' "$FORGE_SLURM_NVIDIA_PROC"/*/information 2>/dev/null)
    if [ -n "$uuid" ]; then
        gpu=$uuid
    else
        no_minor=${no_minor:+$no_minor,}$1
    fi
}

uuid_entry() {  # is $1 a GPU's or a MIG device's UUID as NVML writes it (GPU-/MIG- and 8-4-4-4-12 hex digits)?
    case $1 in GPU-* | MIG-*) ;; *) return 1 ;; esac
    case ${1#????} in
        *[!0-9a-fA-F-]*) return 1 ;;
        ????????-????-????-????-????????????) return 0 ;;
        *) return 1 ;;
    esac
}

add_gpu() {  # $1 onto $gpus, once
    case ",$gpus," in *",$1,"*) ;; *) gpus=${gpus:+$gpus,}$1 ;; esac
}

job_gpus() {  # SLURM_JOB_GPUS, paired with CUDA_VISIBLE_DEVICES -> $gpus ("MIG-...,GPU-...,3"; empty: none)
    gpus=
    no_minor=
    skipped=
    unheld=  # what cannot be held, for the job's line: "'*' (not an index)"
    other=
    whole=
    # Slurm writes both variables in one loop over the job's GRES, one entry per device in the same order
    # (docs/slurm.md): the i-th index of SLURM_JOB_GPUS is the device whose CUDA_VISIBLE_DEVICES entry is the i-th.
    entries=
    for item in $(printf '%s' "${SLURM_JOB_GPUS:-}" | tr ',' ' '); do
        case $item in
            *[!0-9-]* | -* | *-*-* | *-) entries="$entries $item" ;;  # not an index: kept, its place pairs
            *-*) entries="$entries $(seq "${item%-*}" "${item#*-}" | tr '\n' ' ')" ;;
            *) entries="$entries $item" ;;
        esac
    done
    pair=
    if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
        # shellcheck disable=SC2086 # split on purpose: one word per entry (set -f: never a file name pattern)
        n_entries=$(set -- $entries; echo $#)
        # shellcheck disable=SC2046
        n_visible=$(set -- $(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' ' '); echo $#)
        if [ "$n_entries" -eq "$n_visible" ]; then
            pair=1
        else
            say warning "job $SLURM_JOB_ID: SLURM_JOB_GPUS='$SLURM_JOB_GPUS' ($n_entries) and CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' ($n_visible) do not pair entry by entry; Slurm's indices mapped by device minor, which name no MIG device"
        fi
    else
        say info "job $SLURM_JOB_ID: CUDA_VISIBLE_DEVICES is not set (a gres.conf Flags= without nvidia_gpu_env?); Slurm's indices mapped by device minor, which name no MIG device"
    fi
    if [ -n "$pair" ]; then
        # shellcheck disable=SC2046 # split on purpose, as above
        set -- $(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' ' ')
    else
        set --
    fi
    for entry in $entries; do
        visible=
        if [ -n "$pair" ]; then
            visible=$1
            shift
        fi
        if uuid_entry "$visible"; then  # a MIG device's UUID (or a whole GPU's, where Slurm knows it): held by it
            add_gpu "$visible"
            continue
        fi
        parent=${visible#MIG-}
        parent=${parent%%/*}
        case $visible in MIG-GPU-*/*/*) if uuid_entry "$parent"; then  # Slurm's name of a MIG device on a driver
            add_gpu "$parent"                                           # before 470.42.01: held with its GPU
            whole="$whole '$visible'"
            continue
        fi ;; esac
        case $visible in '' | *[!0-9]*) [ -z "$visible" ] || other="$other '$visible'" ;; esac
        case $entry in
            *[!0-9]*) skipped="$skipped '$entry'"; unheld="${unheld:+$unheld, }'$entry' (not an index)"; continue ;;
        esac
        gpu_of_index "$entry"
        add_gpu "$gpu"
    done
    # One line each, however many items: the lines are sent at the end and cost no time here.
    [ -z "$skipped" ] || say warning "job $SLURM_JOB_ID: SLURM_JOB_GPUS='$SLURM_JOB_GPUS': item(s)$skipped not an index (accepted: N or N-M, comma-separated); skipped"
    [ -z "$whole" ] || say warning "job $SLURM_JOB_ID: CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES': MIG device(s)$whole named by GPU and instance (a driver before 470.42.01): held with every MIG device of their GPU"
    [ -z "$other" ] || say warning "job $SLURM_JOB_ID: CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES': entr(ies)$other neither an index nor a GPU or MIG UUID; Slurm's index used instead"
    [ -z "$no_minor" ] || say warning "job $SLURM_JOB_ID: no GPU with device minor $no_minor in $FORGE_SLURM_NVIDIA_PROC; holding NVML index(es) $no_minor"
}

held_report() {  # $1 forge-load hold's exit code, $2 its output (both streams) -> $held (what it says it held), $unheld
    report=$(printf '%s\n' "$2" | awk -v asked="$gpus" -v rc="$1" '
        $2 == "held" && $3 == "by" && $1 ~ /^(GPU|MIG)-[0-9a-fA-F-]+:?$/ {
            sub(/:$/, "", $1); held[tolower($1)] = 1; h = h (h == "" ? "" : ",") $1; next
        }
        match($0, /index [0-9][0-9, ]* is not a GPU/) {  # forge-load hold: "index 7, 9 is not a GPU of this host"
            s = substr($0, RSTART + 6, RLENGTH - 19); gsub(/ /, "", s); bad = bad "," s
        }
        END {
            n = split(asked, a, ","); k = split(substr(bad, 2), b, ","); for (i = 1; i <= k; i++) unknown[b[i]] = 1
            for (i = 1; i <= n; i++) {
                x = a[i]
                if (x ~ /^[0-9]+$/ && (x in unknown)) why = "no GPU of this host has that index"
                else if ((rc != 0 && rc != 1) || (x !~ /^[0-9]+$/ && !(tolower(x) in held))) why = "not held"
                else continue
                m = m (m == "" ? "" : ", ") x " (" why ")"
            }
            print h; print m
        }')
    held=${report%%"$NL"*}
    case $report in *"$NL"*) missed=${report#*"$NL"} ;; *) missed= ;; esac  # $(...) ate a last empty line
    [ -z "$missed" ] || unheld="${unheld:+$unheld, }$missed"
}

guarded() {  # `$0 --guarded START DEADLINE WAIT FORGE_LOAD HOLD_DIR NVIDIA_PROC SETTINGS`, run under timeout
    start=$1 deadline=$2 FORGE_SLURM_WAIT_S=$3 FORGE_LOAD=$4 FORGE_HOLD_DIR=$5 FORGE_SLURM_NVIDIA_PROC=$6
    settings=$7
    holder=slurm-$SLURM_JOB_ID
    if ! command -v "$FORGE_LOAD" >/dev/null 2>&1; then
        say warning "job $SLURM_JOB_ID: no forge-load command ('$FORGE_LOAD'); nothing to $action, the job goes on; $settings"
        return 0
    fi
    if [ "$action" = release ]; then
        err=$("$FORGE_LOAD" release --holder "$holder" --hold-dir "$FORGE_HOLD_DIR" 2>&1 >/dev/null)
        rc=$?
        took=$(since "$start")
        if [ "$rc" -eq 0 ]; then
            say info "job $SLURM_JOB_ID: released $holder in ${took} s; $settings"
        else
            say err "job $SLURM_JOB_ID: forge-load release exited $rc after ${took} s: $(printf '%s' "$err" | head -c 300); $settings"
        fi
        return 0
    fi
    job_gpus
    [ -n "$gpus" ] || return 0
    # The wait, cut where forge-load could not answer PYTHON_S before this phase ends (a slow settings read
    # took its share of the bound).
    wait_s=$(awk -v w="$FORGE_SLURM_WAIT_S" -v d="$deadline" -v r="$PYTHON_S" -v n="$(now_s)" \
        'BEGIN { s = d - r - n; if (s < 0) s = 0; if (w + 0 <= s) print w; else printf "%.3f", s }')
    # Both streams: stdout has a line "UUID held by HOLDER" per GPU held, stderr what was not and why.
    out=$("$FORGE_LOAD" hold --gpu "$gpus" --holder "$holder" --reason "Slurm job $SLURM_JOB_ID" \
        --wait "$wait_s" --hold-dir "$FORGE_HOLD_DIR" 2>&1)
    rc=$?
    took=$(since "$start")
    held_report "$rc" "$out"
    not_held=${unheld:+; not held: $unheld}
    case $rc in
        0) say info "job $SLURM_JOB_ID: held GPU ${held:-none} as $holder in ${took} s (its filler drained, or none runs there)$not_held; $settings" ;;
        1) say warning "job $SLURM_JOB_ID: held GPU ${held:-none} as $holder, no drain acknowledged within ${wait_s} s$not_held; the job starts anyway; $settings" ;;
        *) say err "job $SLURM_JOB_ID: forge-load hold exited $rc after ${took} s: $(printf '%s' "$out" | grep -v ' held by ' | head -c 300); nothing held$not_held; the job starts anyway; $settings" ;;
    esac
}

case ${SLURM_SCRIPT_CONTEXT:-} in
    prolog_slurmd) action=hold ;;
    epilog_slurmd) action=release ;;
    *) case ${0##*/} in *epilog*) action=release ;; *) action=hold ;; esac ;;
esac

case ${1:-} in
    --settings) print_settings; exit 0 ;;
    --guarded) shift; guarded "$@"; exit 0 ;;
esac

# The run as slurmd starts it (no arguments). It opens no file itself: what may block (the settings file,
# forge-load, the syslog socket) runs in a child under `timeout -s KILL`, each within what is left of the
# bound, and the lines for syslog are gathered in $lines and sent last.
[ -n "${SLURM_JOB_GPUS:-}" ] || exit 0  # a job without GPUs: nothing held, nothing to release
start=$(now_s)
exec 2>/dev/null  # what is said goes to syslog; not the shell's "Killed" for a child ended at its phase's end
lines=
found=$(timeout -s KILL "$SETTINGS_S" "$0" --settings 2>/dev/null)
rc=$?
conf=
while IFS= read -r line; do
    case $line in
        'conf '*) conf=${line#conf } ;;
        '<'*) [ "$rc" -ne 0 ] || lines="$lines$line$NL" ;;
        'set '*)
            [ "$rc" -eq 0 ] || continue  # a read cut short: the defaults, never half a file
            key=${line#set }
            key=${key%% *}
            set_setting "$key" "${line#set "$key" }" || :
            ;;
    esac
done <<EOF
$found
EOF
if [ "$rc" -eq 0 ]; then
    settings="settings ${conf:-defaults (no forge-load.conf beside SLURM_CONF or the script)}"
else
    what=${conf:-forge-load.conf (beside SLURM_CONF or the script)}
    case $rc in
        124 | 137) why="did not answer within $SETTINGS_S s (a FIFO? a hung file system?)" ;;
        *) why="could not be read (exit $rc)" ;;
    esac
    settings="settings defaults ($what $why)"
    lines="$lines$(say warning "job $SLURM_JOB_ID: $what $why; the defaults are used")$NL"
fi
bound=$(awk -v w="$FORGE_SLURM_WAIT_S" 'BEGIN { print w + 1 }')
deadline=$(awk -v s="$start" -v b="$bound" 'BEGIN { printf "%.3f", s + b }')
work_s=$(left_before "$deadline" "$LOG_S" "")
if [ -n "$work_s" ]; then
    work_deadline=$(awk -v d="$deadline" -v r="$LOG_S" 'BEGIN { printf "%.3f", d - r }')
    said=$(timeout -s KILL "$work_s" "$0" --guarded "$start" "$work_deadline" "$FORGE_SLURM_WAIT_S" \
        "$FORGE_LOAD" "$FORGE_HOLD_DIR" "$FORGE_SLURM_NVIDIA_PROC" "$settings" 2>/dev/null)
    rc=$?
    [ -z "$said" ] || lines="$lines$said$NL"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        lines="$lines$(say warning "job $SLURM_JOB_ID: $action gave up after $(since "$start") s, at the bound of $bound s less ${LOG_S} s for these lines (forge-load hung?); the job goes on; $settings")$NL"
    fi
fi
log_s=$(left_before "$deadline" "$EXIT_S" "$LOG_S")
if [ -n "$lines" ] && [ -n "$log_s" ]; then
    # One logger for every line: a socket that does not drain holds it until it is killed, and the lines are lost.
    if [ -n "$FORGE_SLURM_SYSLOG_SOCKET" ]; then
        (printf '%s' "$lines" | timeout -s KILL "$log_s" logger --prio-prefix -u "$FORGE_SLURM_SYSLOG_SOCKET" \
            -t "$TAG" -p daemon.info) >/dev/null 2>&1
    else
        (printf '%s' "$lines" | timeout -s KILL "$log_s" logger --prio-prefix -t "$TAG" -p daemon.info) \
            >/dev/null 2>&1
    fi
fi
exit 0
