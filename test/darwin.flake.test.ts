/**
 * flake.nix without network: it parses (as CI checks), and its outputs function, evaluated
 * against a stand-in nixpkgs (package names as strings, the few lib functions it uses), gives a
 * dev shell for x86_64-linux, aarch64-linux and aarch64-darwin with the right tools on each:
 * vfkit on macOS only, the image tools (busybox, dpkg, debootstrap) on Linux only. What it
 * cannot check here: that nixpkgs has these attributes at the pinned revision (that needs a
 * fetch: `nix flake check` or `nix develop` on a connected machine).
 */
import { describe, expect, it } from "@effect/vitest"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"

const root = path.resolve(import.meta.dirname, "..")
const flake = path.join(root, "flake.nix")

const hasNix = (() => {
  try {
    execFileSync("nix-instantiate", ["--version"], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
})()
if (!hasNix) console.warn("flake test skipped: nix-instantiate is not installed")

/** a nixpkgs stand-in: every package the flake may name is its own name */
const STUB = `{ flakeFile }:
let
  flake = import flakeFile;
  names = [ "nodejs_20" "qemu" "e2fsprogs" "cpio" "gnutar" "coreutils" "curl" "git" "busybox" "dpkg" "debootstrap" "vfkit" ];
  genAttrs = ns: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) ns);
  mkPkgs = system:
    let darwin = builtins.match ".*-darwin" system != null;
    in genAttrs names (n: n) // {
      lib = {
        optionals = c: l: if c then l else [ ];
        optionalString = c: s: if c then s else "";
        inherit genAttrs;
      };
      stdenv = { isLinux = !darwin; isDarwin = darwin; };
      mkShell = args: args;
    };
  nixpkgs = {
    lib = { inherit genAttrs; };
    legacyPackages = genAttrs [ "x86_64-linux" "aarch64-linux" "aarch64-darwin" "x86_64-darwin" ] mkPkgs;
  };
  outputs = flake.outputs { self = { }; inherit nixpkgs; };
in {
  inputs = flake.inputs;
  shells = builtins.mapAttrs (system: shells: {
    packages = shells.default.packages;
    hook = shells.default.shellHook;
  }) outputs.devShells;
}
`

interface Shells {
  readonly inputs: { readonly nixpkgs: { readonly url: string } }
  readonly shells: Record<string, { readonly packages: ReadonlyArray<string>; readonly hook: string }>
}

describe.skipIf(!hasNix)("flake.nix", () => {
  it("parses", () => {
    expect(() => execFileSync("nix-instantiate", ["--parse", flake], { stdio: "pipe" })).not.toThrow()
  })

  it("gives each system a dev shell with what building and testing need there", () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-flake-"))
    fs.writeFileSync(path.join(dir, "stub.nix"), STUB)
    const out = execFileSync(
      "nix-instantiate",
      ["--eval", "--strict", "--json", path.join(dir, "stub.nix"), "--arg", "flakeFile", flake],
      { encoding: "utf8" }
    )
    const result = JSON.parse(out) as Shells
    expect(result.inputs.nixpkgs.url).toMatch(/^github:NixOS\/nixpkgs\//)
    expect(Object.keys(result.shells).sort()).toEqual(["aarch64-darwin", "aarch64-linux", "x86_64-linux"])
    for (const [system, shell] of Object.entries(result.shells)) {
      for (const tool of ["nodejs_20", "qemu", "e2fsprogs", "cpio", "git"])
        expect(shell.packages, system).toContain(tool)
      const darwin = system.endsWith("-darwin")
      expect(shell.packages.includes("vfkit"), system).toBe(darwin)
      expect(shell.packages.includes("busybox"), system).toBe(!darwin)
      expect(shell.hook).toContain("ABOX_HOME")
    }
  })
})
