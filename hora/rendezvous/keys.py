"""Where a job's key comes from when no launcher of ours hands one out.

- ``HORA_SECRET``: the text itself (``hora run`` sets it to a fresh random secret per job).
- ``HORA_SECRET_FILE``: a file only its owner can read (mode 0600 or stricter, owned by this
  user); refused, with the ``chmod`` to run, when others may read or write it.
- the per-user secret ``~/.hora/secret``: 32 random bytes in a file of mode 0600 in a
  directory of mode 0700, made by whichever rank of the first job gets there first (an
  exclusive create, then a hard link, so no rank ever reads a half-written file; this works
  on the NFS home directories that Slurm clusters share).  Only this user (and root) can
  read it, so a key made from it is a real secret wherever every rank sees the same home
  directory: every rank of a Slurm job, every rank of a torchrun job on one host.
- otherwise the key is a hash of the job's public identity: anyone who knows those values
  can compute it (the caller runs the control plane in its restricted mode then).

The key of a job is ``HMAC(secret, job identity)``, so one user's jobs never share a key.

Layer: rendezvous.  Imports only hora.errors.
"""
import errno
import hashlib
import hmac
import os
import stat

from ..errors import HoraError

__all__ = ["SecretUnavailable", "derived_key", "job_key", "read_secret_file",
           "user_secret"]

SECRET_DIR = ".hora"
SECRET_NAME = "secret"
_SECRET_BYTES = 32


class SecretUnavailable(HoraError):
    """The per-user secret cannot be used here (the reason is the message); the caller
    falls back to a derivable key and says so."""


def job_key(secret, *identity):
    """The job's key (hex): ``HMAC-SHA256(secret, identity)``."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, "|".join(map(str, identity)).encode(), hashlib.sha256).hexdigest()


def derived_key(*identity):
    """A key anyone who knows ``identity`` can compute (hex); it keeps separate jobs apart
    and proves nothing about who holds it."""
    return hashlib.sha256("|".join(str(p) for p in identity).encode()).hexdigest()


def _private(st, what):
    """A reason why ``st`` is not private to this user, or None."""
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return (f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read or "
                f"change it")
    return None


def read_secret_file(path):
    """The secret in ``path`` (HORA_SECRET_FILE): its text, without surrounding whitespace.

    Raises:
        HoraError: the file is missing, empty, not a regular file, not this user's, or
            readable or writable by others (with the command that fixes it).
    """
    try:
        # a link is followed (mounted secrets often are links): what is checked below is the
        # file it leads to, which is what would be read
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise HoraError(f"HORA_SECRET_FILE={path}: cannot open it: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HoraError(f"HORA_SECRET_FILE={path} is not a regular file")
        reason = _private(st, f"HORA_SECRET_FILE={path}")
        if reason is not None:
            raise HoraError(f"{reason}; refusing to use it as the job secret: run "
                            f"`chmod 600 {path}` (as its owner)")
        text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not text:
        raise HoraError(f"HORA_SECRET_FILE={path} is empty")
    return text


def _read_private(path):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretUnavailable(f"{path} is not a regular file")
        reason = _private(st, path)
        if reason is not None:
            raise SecretUnavailable(reason)
        data = os.read(fd, 4 * _SECRET_BYTES)
    finally:
        os.close(fd)
    try:
        secret = bytes.fromhex(data.decode().strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != _SECRET_BYTES:
        raise SecretUnavailable(f"{path} does not hold a {_SECRET_BYTES}-byte hex secret")
    return secret


def _private_dir(home):
    if not home or not os.path.isabs(home):
        raise SecretUnavailable(f"no usable home directory (HOME={home!r})")
    path = os.path.join(home, SECRET_DIR)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SecretUnavailable(f"cannot create {path}: {e.strerror}") from e
    try:
        st = os.lstat(path)
    except OSError as e:
        raise SecretUnavailable(f"cannot read {path}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise SecretUnavailable(f"{path} is not a directory")
    reason = _private(st, path)
    if reason is not None:
        raise SecretUnavailable(reason)
    return path


def user_secret(home):
    """This user's secret (bytes) from ``<home>/.hora/secret``, made on first use.

    Raises:
        SecretUnavailable: the home directory is missing, unwritable, or the directory or
            file is not private to this user (never repaired here: someone else made it).
    """
    directory = _private_dir(home)
    path = os.path.join(directory, SECRET_NAME)
    try:
        return _read_private(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise SecretUnavailable(f"cannot read {path}: {e.strerror}") from e
    # write a complete file under a name of our own, then link it into place: the link
    # fails if another rank won, and nobody ever sees a file without its secret
    tmp = os.path.join(directory, f".{SECRET_NAME}.{os.getpid()}.{os.urandom(6).hex()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (os.urandom(_SECRET_BYTES).hex() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
    except OSError as e:
        raise SecretUnavailable(f"cannot create {path}: {e.strerror}") from e
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    try:
        return _read_private(path)
    except OSError as e:
        raise SecretUnavailable(f"cannot read {path}: {e.strerror}") from e
