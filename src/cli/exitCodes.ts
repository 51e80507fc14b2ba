/**
 * One exit code per error tag (docs/exit-codes.md is the table for users; a test keeps the two
 * in step). Codes live in 64–99 so that `abox run`, which exits with the turn's own status,
 * rarely collides with them: 0–63 and 128+ are the guest's.
 */
export const exitCodeByTag: Readonly<Record<string, number>> = {
  // usage (bad flags, arguments)
  ValidationError: 64,
  // usage too (64 like ValidationError, their own tags): an ABOX_* environment variable abox does
  // not accept; --cpus or --memory out of range (open/run/resume)
  ConfigInvalid: 64,
  InvalidOption: 64,
  // store
  SessionNotFound: 65,
  SessionCorrupt: 66,
  SessionFormatTooNew: 67,
  StoreIoError: 68,
  NameTaken: 69,
  InvalidName: 70,
  // CLI: `rm` without --yes and no terminal to ask on; the user said no
  ConfirmationRequired: 71,
  Cancelled: 72,
  // open: the source directory is missing or not a directory
  SourceInvalid: 73,
  // $ABOX_HOME/models.json does not decode
  ModelCatalogError: 100,
  // exec -t: the session's guest image predates tty turns (its hello lacks the "tty" feature)
  TtyUnsupported: 101,
  // lock
  SessionBusy: 75,
  LockError: 76,
  // detached sessions: nobody serves the session's control socket; the control connection failed
  SessionNotRunning: 78,
  ControlError: 79,
  // forward: the guest could not connect to the port
  ForwardRefused: 74,
  // resume: the session was made for another arch, backend, or predates that metadata
  SessionIncompatible: 77,
  // VMM
  VmmError: 80,
  VmmUnavailable: 81,
  // diff / apply / cp: a path outside the repository or taken; git missing or failing on the host
  RepoPathInvalid: 82,
  RepoToolFailed: 83,
  // diff / apply / cp: an archive from the guest broke a rule
  ArchiveRefused: 84,
  // guest protocol
  GuestTooOld: 85,
  GuestTooNew: 86,
  ProtocolError: 87,
  GuestTimeout: 88,
  GuestDisconnected: 89,
  TransferFailed: 90,
  // images and disks
  ImageNotFound: 91,
  ImageInUse: 92,
  ImageBuildFailed: 93,
  DiskError: 94,
  // broker
  BrokerPolicyError: 95,
  BrokerError: 96,
  // apply: the source changed where the patch writes; the patch does not apply
  SourceChanged: 97,
  PatchFailed: 98,
  MergeConflicts: 102,
  // image import: the archive is not an image abox takes, or breaks a rule of untrusted input
  ImageImportRefused: 110,
  // environments (docs/environments.md): the repository's environment file does not decode; its
  // setup failed (no image made); its install command failed after Open (nothing kept)
  EnvironmentInvalid: 111,
  EnvironmentSetupFailed: 112,
  EnvironmentInstallFailed: 113
}

/** anything without its own code */
export const UNKNOWN_ERROR_EXIT = 99

export const exitCodeFor = (tag: string): number => exitCodeByTag[tag] ?? UNKNOWN_ERROR_EXIT
