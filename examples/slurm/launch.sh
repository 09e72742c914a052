# Sourced by the sbatch scripts in this folder; submit them from the repository root (a batch
# job starts in the directory it was submitted from).
#
#   launch_ranks CMD [ARGS...]
#
# runs CMD once per Slurm task, with torch.distributed's env:// variables (RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR, MASTER_PORT) taken from Slurm's, and requeues the job when Slurm
# warns that it is about to end it.
#
# One task per rank, rather than torchrun or the deepspeed launcher under srun: Slurm then
# signals every rank itself (preemption sends SIGTERM to all tasks), and no agent stands in
# between that could SIGKILL ranks still writing their checkpoint (torchrun gives its workers
# 30 s by default) or exit without passing a signal on.
#
# Preemption and time limits, step by step:
#  1. Slurm sends USR1 to this batch shell (`#SBATCH --signal=B:USR1@T`: T seconds before the
#     time limit; at preemption too where the cluster sets preempt_send_user_signal), and the
#     trap passes it to srun, which passes it to every rank. Or Slurm preempts the job and
#     sends SIGTERM to the ranks itself.
#  2. The ranks (--exit-signal-handler) finish the current iteration, save a checkpoint and
#     exit 0. Signals after the first are not passed on (and the ranks absorb any that reach
#     them) until the save is done: scancel's TERM or the time limit's must not kill it.
#     The save must fit between the warning and the time limit: see docs/launchers.md's SLURM
#     section for the --signal=B:USR1@N that TACO-base and SAS-base need.
#  3. Once srun has returned, `scontrol requeue` puts the job back in the queue (it needs
#     `#SBATCH --requeue`). Slurm runs this script again from the top, and --load, which names
#     the --save directory, resumes from the checkpoint just written.
# `scancel` (TERM) also makes the ranks save and exit, but the job stays cancelled.
#
# MASTER_ADDR (default: the first node of the job) and MASTER_PORT (default: derived from the
# job id, so that two jobs sharing a node do not collide) may be set before sbatch; sbatch
# passes the submitting environment on.

_launch_signal=""
_launch_step_pid=""
_launch_forwarded=""

_launch_preempted() {
    # Slurm's own preemption (PreemptMode=REQUEUE, with a GraceTime) sends SIGTERM to the
    # job's steps, not to this shell, and records when. The ranks then save and exit 0, and a
    # job that ends by itself within its grace time is recorded as completed, not requeued.
    scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -qE 'PreemptTime=[0-9]'
}

_launch_on_signal() {
    # Only USR1, the warning asked for with --signal, requeues: TERM here is scancel's, and
    # requeueing would undo the cancel.
    if [[ $1 == USR1 ]]; then
        _launch_signal=USR1
    fi
    # No `return` in here: bash would return from launch_ranks, whose `wait` the trap
    # interrupted, with that wait's status.
    if [[ -n $_launch_forwarded ]]; then
        # The ranks are already saving: another signal could only interrupt the save (they
        # absorb it too, in case Slurm signals them directly).
        echo "launch.sh: SIG$1 at $(date '+%F %T'): the ranks are already saving; not passed on" >&2
    else
        echo "launch.sh: SIG$1 at $(date '+%F %T'): the ranks save a checkpoint and exit" >&2
        # USR1 whatever came in: the ranks' handler takes it, and srun passes it on unchanged.
        if [[ -n $_launch_step_pid ]] && kill -USR1 "$_launch_step_pid" 2>/dev/null; then
            _launch_forwarded=1
        fi
    fi
}

launch_ranks() {
    if [[ -z ${MASTER_ADDR:-} ]]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    fi
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    export MASTER_ADDR MASTER_PORT
    echo "launch.sh: job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)):" \
        "$SLURM_NTASKS ranks on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2

    trap '_launch_on_signal USR1' USR1
    trap '_launch_on_signal TERM' TERM
    # In the background: bash runs a trap only once the foreground command has returned, which
    # for srun would be after the ranks were killed. --kill-on-bad-exit: one failed rank ends
    # the step instead of leaving the others waiting in a collective.
    srun --kill-on-bad-exit=1 bash -c \
        'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
         exec "$@"' rank "$@" &
    _launch_step_pid=$!
    # `wait` returns early (status > 128) whenever a trap ran; srun may still be running.
    while kill -0 "$_launch_step_pid" 2>/dev/null; do
        wait "$_launch_step_pid" || true
    done
    local rc=0
    wait "$_launch_step_pid" || rc=$?
    trap - USR1 TERM
    _launch_step_pid=""

    if [[ -z $_launch_signal ]] && _launch_preempted; then
        _launch_signal=preemption
        echo "launch.sh: job $SLURM_JOB_ID was preempted" >&2
    fi
    if [[ -n $_launch_signal ]]; then
        # Requeued even when the ranks failed: the next start resumes from the latest complete
        # checkpoint, which is what a preempted job wants.
        echo "launch.sh: ranks exited with status $rc; requeueing job $SLURM_JOB_ID" >&2
        if scontrol requeue "$SLURM_JOB_ID"; then
            # Slurm ends this shell now; this run's end is recorded as the requeue.
            exit 0
        fi
        echo "launch.sh: scontrol requeue failed (submitted without --requeue?)" >&2
        return 1
    fi
    return "$rc"
}
