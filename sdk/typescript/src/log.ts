/** Structured logs: the SDK reports what it sees (event name and fields), the application decides where
 * they go. The default writes JSON lines to stderr. */

export type LogLevel = "debug" | "info" | "warn" | "error";

export type Logger = (level: LogLevel, message: string, fields: Record<string, unknown>) => void;

const RANK: Record<LogLevel, number> = { debug: 10, info: 20, warn: 30, error: 40 };

/** A logger writing one JSON object per line, dropping levels below `minLevel`. */
export function jsonLogger(minLevel: LogLevel = "warn",
  write: (line: string) => void = (line) => process.stderr.write(`${line}\n`)): Logger {
  return (level, message, fields) => {
    if (RANK[level] < RANK[minLevel]) return;
    write(JSON.stringify({ time: new Date().toISOString(), level, message, ...fields }));
  };
}
