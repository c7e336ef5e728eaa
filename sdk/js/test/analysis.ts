/** The analysis.py the snippet runs: prints its numbers and saves a chart (matplotlib, in
 * the python template). */
export const ANALYSIS = `
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

xs = list(range(10))
ys = [x * x for x in xs]
for x, y in zip(xs, ys):
    print(f"{x} squared is {y}")
plt.plot(xs, ys, marker="o")
plt.title("squares")
plt.savefig("/work/chart.png")
print("saved /work/chart.png")
`;
