{
  description = "abox: run an AI coding agent inside a real VM session";

  # 25.05: vfkit >= 0.6 (the `readonly` flag on virtio-blk that the config disk needs)
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.05";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" "aarch64-darwin" ];
      forAll = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in {
      devShells = forAll (pkgs:
        let
          inherit (pkgs) lib stdenv;
          # build and test: bundles (node), image recipes (e2fsprogs, cpio, tar), VMs (qemu)
          common = [ pkgs.nodejs_20 pkgs.qemu pkgs.e2fsprogs pkgs.cpio pkgs.gnutar pkgs.coreutils pkgs.curl pkgs.git ];
          # image builds use Debian tools and a static busybox: Linux hosts only
          linuxOnly = lib.optionals stdenv.isLinux [ pkgs.busybox pkgs.dpkg pkgs.debootstrap ];
          # the vz backend: vfkit (Virtualization.framework), signed with the virtualization entitlement
          darwinOnly = lib.optionals stdenv.isDarwin [ pkgs.vfkit ];
        in {
          default = pkgs.mkShell {
            packages = common ++ linuxOnly ++ darwinOnly;
            shellHook = ''
              export ABOX_HOME="''${ABOX_HOME:-$HOME/.abox}"
              echo "abox dev shell: node $(node --version), $(qemu-img --version | head -1)"
            '' + lib.optionalString stdenv.isDarwin ''
              echo "vz backend: $(vfkit --version 2>/dev/null || echo 'vfkit missing')"
            '';
          };
        });
    };
}
