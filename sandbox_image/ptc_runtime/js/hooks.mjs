// Module hooks of a script's process (registered by main.mjs): `import ... from "tools"` is the run's generated
// module (/run/ptc/tools.mjs), and a TypeScript script is type-stripped by esbuild (Debian's package; no type check)
// as it loads, with an inline source map so that stack traces give the lines of the script as sent.
import { spawnSync } from "node:child_process";

const RUN_DIR = "file:///run/ptc/";
const TOOLS_URL = RUN_DIR + "tools.mjs";
const ESBUILD = "/usr/bin/esbuild";
const MAX_SOURCE_BYTES = 64 * 1024 * 1024;

export async function resolve(specifier, context, next) {
  if (specifier === "tools") return { url: TOOLS_URL, format: "module", shortCircuit: true };
  return next(specifier, context);
}

export class TypeScriptSyntaxError extends SyntaxError {}

function transpile(source, name) {
  const run = spawnSync(
    ESBUILD,
    ["--loader=ts", "--format=esm", "--target=esnext", "--sourcemap=inline", `--sourcefile=${name}`, "--log-level=error", "--color=false"],
    { input: source, encoding: "utf8", maxBuffer: MAX_SOURCE_BYTES },
  );
  if (run.error) throw new Error(`cannot run the TypeScript transpiler (${ESBUILD}): ${run.error.message}`);
  const report = (run.stderr || "").trim();
  if (run.signal !== null || (run.status !== 0 && !report.includes("[ERROR]"))) {
    // Killed (the sandbox's memory limit), or failed without a report of the script's (no thread to start): the
    // transpiler's failure, not the script's syntax.
    const how = run.signal !== null ? `was killed by ${run.signal} (out of memory?)` : `failed (exit code ${run.status})`;
    throw new Error(`the TypeScript transpiler ${how}: ${report.slice(0, 2000) || "no report"}`);
  }
  if (run.status !== 0) {
    // esbuild's report: "✘ [ERROR] <message>\n\n    script.ts:LINE:COLUMN:\n ..." (the first error is the one reported)
    const message = /\[ERROR\] ([^\n]*)/.exec(report)?.[1] ?? "the TypeScript transpiler refused the script";
    const where = new RegExp(`${name.replace(/\./g, "\\.")}:(\\d+):(\\d+):`).exec(report);
    const error = new SyntaxError(message);
    if (where) {
      error.ptcLine = Number(where[1]);
      error.ptcColumn = Number(where[2]) + 1;
    }
    error.ptcReport = report;
    throw error;
  }
  return run.stdout;
}

export async function load(url, context, next) {
  if (url === TOOLS_URL) return { ...(await next(url, { ...context, format: "module" })), format: "module" };
  if (url.startsWith(RUN_DIR) && url.endsWith(".ts")) {
    const loaded = await next(url, { ...context, format: "module" });
    const name = url.slice(RUN_DIR.length);
    return { format: "module", source: transpile(Buffer.from(loaded.source).toString("utf8"), name), shortCircuit: true };
  }
  return next(url, context);
}
