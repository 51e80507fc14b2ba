import tseslint from "typescript-eslint"

export default tseslint.config(
  { ignores: ["dist/**", "node_modules/**", ".build/**"] },
  ...tseslint.configs.recommended,
  {
    // type-aware rules: spreading an Effect (an Iterable) into options type-checks, and a floating
    // Promise loses its failure; both have shipped bugs here
    files: ["**/*.ts"],
    languageOptions: { parserOptions: { projectService: true, tsconfigRootDir: import.meta.dirname } },
    rules: {
      "@typescript-eslint/no-misused-spread": ["error", { allow: [{ from: "lib", name: "string" }] }],
      "@typescript-eslint/no-floating-promises": "error"
    }
  },
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
