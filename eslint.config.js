import tseslint from "typescript-eslint"

export default tseslint.config(
  { ignores: ["dist/**", "node_modules/**", ".build/**"] },
  ...tseslint.configs.recommended,
  {
    rules: {
      "@typescript-eslint/no-unused-vars": ["error", { argsIgnorePattern: "^_", varsIgnorePattern: "^_" }],
      "@typescript-eslint/no-explicit-any": "error",
      "@typescript-eslint/consistent-type-imports": "error",
      "no-restricted-imports": [
        "error",
        {
          paths: [
            { name: "@effect/platform-node", message: "Deep-import (e.g. @effect/platform-node/NodeRuntime): barrels slow CLI start-up." },
            { name: "@effect/cli", message: "Deep-import (e.g. @effect/cli/Command): barrels slow CLI start-up." },
            { name: "@effect/platform", message: "Deep-import (e.g. @effect/platform/FileSystem): barrels slow CLI start-up." },
            { name: "effect", message: "Deep-import (e.g. effect/Effect): barrels slow CLI start-up." }
          ]
        }
      ]
    }
  }
)
