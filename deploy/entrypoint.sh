#!/bin/sh
# Start-up of hora's images (deploy/Dockerfile, deploy/Dockerfile.cuda).
#
#   train        SageMaker's bring-your-own-container entry point (`docker run IMAGE train`):
#                run the job the way hora's SageMaker integration does (sagemaker_train.py).
#   sshd [ARGS]  a host of a SageMaker MPI job (or an MPIJob worker whose command is this
#                script): make SSH host keys if there are none, run sshd in the foreground.
#   anything     run as given (an MPIJob launcher's `mpirun ...`, `hora run ...`, a shell).
#
# HORA_SSHD (default /usr/sbin/sshd), HORA_SSH_KEYGEN (ssh-keygen) and HORA_TRAIN_SCRIPT
# (this directory's sagemaker_train.py) name the programs, so the script can be run outside
# an image.
set -eu

here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)
: "${HORA_SSHD:=/usr/sbin/sshd}"
: "${HORA_SSH_KEYGEN:=ssh-keygen}"
: "${HORA_TRAIN_SCRIPT:=$here/sagemaker_train.py}"
: "${HORA_PYTHON:=python3}"

if [ $# -eq 0 ]; then
    set -- train
fi

case $1 in
    train)
        shift
        exec "$HORA_PYTHON" "$HORA_TRAIN_SCRIPT" "$@"
        ;;
    sshd)
        shift
        # make the host keys an image without them lacks (ssh-keygen -A makes only the
        # missing ones; hora's images keep those made at install, see deploy/Dockerfile)
        "$HORA_SSH_KEYGEN" -A
        exec "$HORA_SSHD" -De "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
