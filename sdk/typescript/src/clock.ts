/** Time as the SDK sees it: a monotonic clock for ownership, and sleeps. Injectable for tests. */

export interface SleepOptions {
  /** Ends the sleep early (the sleep then resolves, it does not reject). */
  signal?: AbortSignal;
  /** false: the sleep alone does not keep the process alive (the heartbeat's wait). */
  keepAlive?: boolean;
}

export interface Clock {
  /** Monotonic seconds (any origin); never goes back when the wall clock is set. */
  now(): number;
  sleep(seconds: number, options?: SleepOptions): Promise<void>;
}

export const systemClock: Clock = {
  now: () => performance.now() / 1000,
  sleep: (seconds, options = {}) => new Promise<void>((resolve) => {
    const { signal, keepAlive = true } = options;
    if (signal?.aborted) {
      resolve();
      return;
    }
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, Math.max(0, seconds) * 1000);
    if (!keepAlive) timer.unref();
    signal?.addEventListener("abort", done, { once: true });
  }),
};
