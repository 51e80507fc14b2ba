{
  description = "abox: run an AI coding agent inside a real VM session";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" "aarch64-darwin" ];
      forAll = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in {
      devShells = forAll (pkgs:
        let
          inherit (pkgs) lib stdenv;
          common = [ pkgs.nodejs_20 pkgs.qemu pkgs.e2fsprogs pkgs.cpio pkgs.gnutar pkgs.coreutils pkgs.curl pkgs.git ];
          linuxOnly = lib.optionals stdenv.isLinux [ pkgs.busybox pkgs.dpkg pkgs.debootstrap ];
          darwinOnly = lib.optionals stdenv.isDarwin [ pkgs.vfkit ];
        in {
          default = pkgs.mkShell {
            packages = common ++ linuxOnly ++ darwinOnly;
            shellHook = ''
              export ABOX_HOME="''${ABOX_HOME:-$HOME/.abox}"
              echo "abox dev shell: node $(node --version), $(qemu-img --version | head -1)"
            '';
          };
        });
    };
}
